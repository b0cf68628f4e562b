"""GPU tier of the executor: one training step of a Hugging Face model through `train_step`
on CUDA, with the compiled Triton kernel, against the same step on the CPU in fp64 with
the torch backend (transformers' model built from a small config, nothing downloaded).

The GPU case is skipped without CUDA (conftest); `scripts/gpu_check.sh` runs it. `_step_on`
is the whole check, device and dtype given, and the CPU tier runs it too, with the
interpreted kernel in fp32.
"""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

import wlb_opt as wlb  # noqa: E402
from wlb_opt.executor import train_step  # noqa: E402
from wlb_opt.integrations import hf  # noqa: E402

# head dim 32: the smallest the GPU kernels' tiles take (tl.dot needs 16 or more)
CONFIG = dict(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024)


def _step():
    rng = np.random.default_rng(0)
    lengths = [1, 300] + rng.integers(2, 120, 14).tolist()  # a one-token piece, a document cut in pieces
    docs = [(10 + i, rng.integers(0, CONFIG["vocab_size"], k)) for i, k in enumerate(lengths)]
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(), wlb.HardwareSpec.preset("cpu"))
    packer = wlb.WLBPacker(2, 256, cost, config=wlb.PackerConfig(thresholds=[]))
    return next(iter(wlb.WLBStream(docs, packer, 512, window=128)))


def _model(dtype, device):
    hf.register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**copy.deepcopy(CONFIG)),
                                                          attn_implementation="wlb", dtype=torch.float64)
    return model.to(device=device, dtype=dtype)


def _step_on(device: str, dtype, backend: str):
    """(loss, {name: grad}) of one step on `device`, and the fp64 CPU reference's."""
    step = _step()
    model = _model(dtype, device)
    ref = _model(torch.float64, "cpu")
    loss = train_step(hf.split_hf_stages(model, 1)[0], step.plan, step.shards, data=step, backend=backend)
    ref_loss = train_step(hf.split_hf_stages(ref, 1)[0], step.plan, step.shards, data=step, backend="torch")
    grads = {n: p.grad.detach().to("cpu", torch.float64) for n, p in model.named_parameters()}
    return loss, ref_loss, grads, {n: p.grad for n, p in ref.named_parameters()}


def _check(loss, ref_loss, grads, ref_grads, rtol):
    assert np.isfinite(loss) and abs(loss - ref_loss) <= rtol * abs(ref_loss), (loss, ref_loss)
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().item()
        err = (g - ref_grads[name]).abs().max().item()
        assert err <= rtol * max(scale, 1e-6), f"{name}: max error {err:.3g} against a largest gradient of {scale:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="GPU tests need TRITON_INTERPRET=0 (compiled kernels)")
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)])
def test_a_training_step_on_cuda_equals_the_cpu_step(dtype, rtol):
    _check(*_step_on("cuda", dtype, "triton"), rtol=rtol)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="the CPU tier runs the interpreter")
def test_a_training_step_with_the_interpreted_kernel_equals_the_fp64_step():
    _check(*_step_on("cpu", torch.float32, "triton"), rtol=2e-3)
