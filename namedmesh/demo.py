"""`make demo`: a short tour of named-axis scripting (until the model zoo takes over)."""

import numpy as np

import namedmesh as nm


def main() -> None:
    rng = np.random.default_rng(0)
    x = nm.tensor(rng.normal(size=(4, 8)).astype(np.float32), "batch d_model")
    w = nm.tensor(rng.normal(size=(8, 16)).astype(np.float32), "d_model d_ff")
    print("x =", repr(x).splitlines()[0], " w =", repr(w).splitlines()[0])

    def layer(x, w):
        h = nm.gelu(nm.einsum(x, w))  # contracts d_model, the dim x and w share
        return nm.log_softmax(h, "d_ff").mean("batch")

    eager = layer(x, w)
    print("\neager result:", eager)

    graph = nm.trace(layer, x, w)
    print("\ntraced graph:\n" + str(graph))

    h = x.data @ w.data
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    ref = (h - np.log(np.exp(h).sum(axis=1, keepdims=True))).mean(axis=0)
    err = max(np.abs(eager.data - ref).max(), np.abs(nm.reference(graph)(x, w).data - ref).max())
    print(f"\nmax |namedmesh - positional NumPy| = {err:.2e}")
    if err > 1e-4:
        raise SystemExit("demo: namedmesh disagrees with NumPy")


if __name__ == "__main__":
    main()
