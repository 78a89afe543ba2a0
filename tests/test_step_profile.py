"""benchmarks/step_profile.py puts Mixtral's experts' kernel (namedmesh/grouped_slots.py,
run under its named scope) in its own buckets, forward and backward: its loops' dots
with the matmuls, their other ops (read from a compiled gradient's HLO) with the
experts beside their dots, none with attention, whose fused kernel runs a cond."""

import jax
import jax.numpy as jnp
import numpy as np

import namedmesh as nm
from benchmarks import experts_profile, step_profile

R = np.random.default_rng(0)


def test_the_experts_kernel_is_bucketed_by_its_scope():
    wi, wo = (nm.tensor(R.normal(size=s).astype(np.float32), d)
              for s, d in (((4, 8, 16), "experts d f"), ((4, 16, 8), "experts f o")))  # fmt: skip
    g = nm.tensor((np.arange(128) % 4).reshape(64, 2).astype(np.int32), "t k")

    def step(x):  # the profile reads the op names under jit(step)
        return jnp.sum(jnp.sin(nm.grouped_ffn(nm.tensor(x, "t d"), wi, wo, g).data))

    hlo = jax.jit(jax.grad(step)).lower(np.ones((64, 8), np.float32)).compile().as_text()
    meta = experts_profile.fusion_callees(hlo) | experts_profile.metadata(hlo)
    shape = step_profile.shapes(hlo)
    kernel = {k: m for k, m in meta.items() if "while/body" in m}  # the kernel's loops' ops
    sides = {("transpose(" in m, k.startswith(("dot", "ynn_fusion")) and "dot_general" in m)
             for k, m in kernel.items()}  # fmt: skip
    assert sides == {(False, False), (False, True), (True, False), (True, True)}, kernel
    for k, m in kernel.items():
        dot = k.startswith(("dot", "ynn_fusion")) and "dot_general" in m
        want = step_profile.BUCKETS[0] if dot else step_profile.BUCKETS[8]
        assert step_profile.xla_bucket(k, m, shape.get(k, ""), 1, 8192) == want, (k, m)
    assert step_profile.torch_bucket("aten::_grouped_mm") == step_profile.BUCKETS[8]
    assert step_profile.torch_bucket("aten::mm") == step_profile.BUCKETS[0]
