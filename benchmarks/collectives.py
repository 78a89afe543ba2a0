"""Collective bytes per device of one training step (forward, backward and gradient
sync), read from compiled HLO, for namedmesh, XLA's automatic partitioner (GSPMD) and
a hand-written `jax.shard_map`, beside the analytical minimum.

The models, layouts and minimum are in benchmarks/cases.py, the three ways of building
a step in benchmarks/steps.py. Bytes sent per device follow ring collectives over n
devices with S the bytes each device holds: all-reduce 2(n-1)/n S, reduce-scatter and
all-gather (n-1)/n of the larger side, all-to-all (n-1)/n S (lowering/cost.py). Each
case also times the steps, interleaved, reads their peak memory (benchmarks/memory.py)
and holds the cost model's forward bytes against the forward pass's compiled HLO.
"""

from __future__ import annotations

import jax
import numpy as np

from benchmarks import cases, memory, report, steps
from lowering import Mesh, lower
from lowering.hlo import collectives
from lowering.rates import median_seconds


def hlo_traffic(hlo_text: str) -> float:
    """Bytes one device sends for all collectives of compiled HLO (ring algorithms)."""
    total = 0.0
    for kind, result, n in collectives(hlo_text):
        if kind == "all-reduce":
            total += 2 * (n - 1) / n * result
        elif kind == "reduce-scatter":
            total += (n - 1) * result
        elif kind in ("all-gather", "all-to-all"):
            total += (n - 1) / n * result
        else:  # collective-permute: the whole buffer
            total += result
    return total


def measure(model: cases.Model, case: cases.Case, repeats: int = 5) -> dict:
    """Bytes per device per step and median step seconds of each implementation, the
    minimum, and the cost model's forward bytes beside the forward HLO's; raises if the
    implementations' gradients disagree."""
    params, x = model.inputs()
    made = {
        "namedmesh": steps.namedmesh_step(model.loss, params, x, case.mesh, case.rules),
        "gspmd": steps.gspmd_step(model.loss, params, x, case.mesh, case.rules),
    }
    if case.hand:
        made["hand"] = cases.hand_step(model, case, params, x)
    out = {"minimum": cases.minimum(model, case, params), "bytes": {}, "grads": {}}
    out["memory"] = {}
    for name, (fn, args) in made.items():
        compiled = fn.lower(*args).compile()
        out["bytes"][name] = hlo_traffic(compiled.as_text())
        out["memory"][name] = memory.peak_bytes(compiled)
        out["grads"][name] = steps.gradients(fn, args)  # also the warm-up call
    for name, g in out["grads"].items():
        for a, r in zip(g, out["grads"]["gspmd"], strict=True):
            if not np.allclose(a, r, rtol=1e-3, atol=1e-5):
                raise AssertionError(f"{model.name} {case.name}: {name}'s gradients differ")
    out["seconds"] = median_seconds(made, repeats)
    f = lower(model.loss, Mesh(case.mesh), case.rules)
    placed = made["namedmesh"][1]  # (params, x) as the lowered loss takes them
    out["ideal_memory"] = memory.ideal_bytes(model.loss, params, x, case.mesh, case.rules)
    out["report"] = rep = f.report(*placed, wrt=0, show=False)  # the parameters' gradients
    out["predicted"] = rep.bytes
    out["forward_hlo"] = hlo_traffic(f.compile(*placed).as_text())
    # value_and_grad, not grad: XLA drops the loss's own psum when the loss is unused
    train = jax.jit(jax.value_and_grad(lambda p, x: f(p, x).data))
    out["training_predicted"] = rep.bytes + rep.backward_bytes
    out["training_hlo"] = hlo_traffic(train.lower(*placed).compile().as_text())
    return out


def rows(size: str = "full", repeats: int = 5, progress=None, machine=None) -> list[dict]:
    """Rows in the results schema (benchmarks/report.py): per case, collective bytes per
    training step, step seconds, peak memory, the cost model's forward and training-step
    bytes beside the HLO's, and with a `roofline.Machine` its step time beside the
    measured one."""
    out = []
    for model in cases.models(size):
        for case in model.cases:
            m = measure(model, case, repeats)
            mesh = "x".join(f"{a}={s}" for a, s in case.mesh.items())
            key = (model.name, f"{case.name}: {case.rules}", mesh)
            for bench, metric, figures, least in (
                ("collective_bytes", "bytes sent per device per training step", m["bytes"],
                 m["minimum"]),
                ("step_time", f"median seconds per training step ({repeats} interleaved)",
                 m["seconds"], None),
                ("peak_memory", "peak bytes per device of the training step (XLA); minimum: "
                 "the ideal", m["memory"], m["ideal_memory"]),
            ):  # fmt: skip
                others = {"minimum": least, "gspmd": figures["gspmd"], "hand": figures.get("hand")}
                out.append(report.row(bench, *key, metric, figures["namedmesh"], **others))
            for metric, v in (
                ("forward bytes per device, cost model", m["predicted"]),
                ("forward bytes per device, compiled HLO", m["forward_hlo"]),
                ("training-step bytes per device, cost model", m["training_predicted"]),
                ("training-step bytes per device, compiled HLO", m["training_hlo"]),
            ):
                out.append(report.row("cost_model_bytes", *key, metric, v))
            if machine is not None:
                for metric, v in (
                    ("seconds per training step, cost model", machine.seconds(m["report"])),
                    ("seconds per training step, measured", m["seconds"]["namedmesh"]),
                ):
                    out.append(report.row("cost_model_time", *key, metric, v))
            if progress is not None:
                progress()
    return out


def count(size: str) -> int:
    return sum(len(m.cases) for m in cases.models(size))
