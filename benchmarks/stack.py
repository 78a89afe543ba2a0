"""The hardware and math libraries behind a table's figures, for its header: the CPU
(its model name and the vector and matrix extensions its flags list), PyTorch's BLAS
and oneDNN versions (`torch.__config__.show()`), jax and jaxlib's versions and the
kernel library XLA:CPU runs a matmul with (read from a compiled dot's HLO), the date
and the load. A ratio of two libraries on one CPU says little about another: PyTorch's
MKL, for one, is slower on AMD's CPUs than on Intel's."""

from __future__ import annotations

import datetime
import re

from benchmarks import fair

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu() -> str:
    """'MODEL (flags: ...)' from /proc/cpuinfo; 'unknown CPU' where it is unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    have = set(flags.group(1).split()) if flags else set()
    listed = [f for f in FLAGS if f in have] or ["none of " + ", ".join(FLAGS)]
    return f"{model.group(1).strip() if model else 'unknown CPU'} (flags: {', '.join(listed)})"


def torch_libraries() -> str:
    """PyTorch's version and its BLAS and oneDNN lines of `torch.__config__.show()`."""
    import torch

    shown = torch.__config__.show()
    blas = re.search(r"Math Kernel Library Version ([\d.]+)", shown)
    dnn = re.search(r"(?:MKL-DNN|oneDNN) (v[\d.]+)", shown)
    blas_info = re.search(r"BLAS_INFO=(\w+)", shown)
    parts = [f"PyTorch {torch.__version__}"]
    parts.append(
        f"MKL {blas.group(1)}" if blas else f"BLAS {blas_info.group(1) if blas_info else '?'}"
    )
    parts.append(f"oneDNN {dnn.group(1)}" if dnn else "no oneDNN")
    return ", ".join(parts)


def xla_dot_library() -> str:
    """The kernel library of XLA:CPU's fp32 dot, as its compiled HLO names it: YNNPACK
    (a `__ynn_fusion`), oneDNN, or XLA's own (Eigen) dot."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 64), jnp.float32)
    text = jax.jit(jnp.matmul).lower(x, x).compile().as_text()
    if "__ynn" in text:
        return "YNNPACK"
    if "onednn" in text.lower():
        return "oneDNN"
    return "Eigen (XLA's dot)"


def jax_libraries() -> str:
    import jax
    import jaxlib

    return (
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, XLA:CPU dots by {xla_dot_library()}"
    )


def describe() -> str:
    """One line for a table's header: CPU, both sides' libraries, the time and load now
    (a table's, at its end)."""
    import transformers

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"CPU: {cpu()}. Libraries: {torch_libraries()}, transformers "
        f"{transformers.__version__}; {jax_libraries()}. {when}, load average "
        f"(1/5/15 min) {fair.load()}."
    )
