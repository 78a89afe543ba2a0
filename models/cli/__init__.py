"""The command line: one module per `namedmesh` subcommand (train, generate, eval, export,
plan, launch, demo) and the flags they share."""
