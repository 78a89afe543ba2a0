"""Training: the data and its batches, the objectives, the optimizer, which parameters
train, the step on a mesh, checkpoints, and the run behind `namedmesh train` with its
faults (preemption, a lost peer)."""
