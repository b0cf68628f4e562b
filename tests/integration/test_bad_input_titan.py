"""Bad input to the torchtitan adapter: clear errors of the library's own, raised before
anything is built.

Same contract as `tests/unit/test_bad_input.py` (whose checker this reuses): each case is (id,
call, exception type, message fragment naming the value or what is valid). Model configs come
from torchtitan's own registries (configs only, nothing is built).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from test_bad_input import _check  # noqa: E402

import wlb_opt as wlb  # noqa: E402
from wlb_opt.integrations import torchtitan as tt  # noqa: E402


def _registry(family: str, flavor: str):
    from importlib import import_module

    return import_module(f"torchtitan.models.{family}").model_registry(flavor).model


def _stream(dp: int = 1, n_micro: int = 2, lengths=(40, 300, 7)):
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), None, wlb.HardwareSpec.preset("cpu")).without_layout()
    docs = [(i, np.arange(n) % 97) for i, n in enumerate(lengths)]
    packer = wlb.WLBPacker(n_micro, 512, cost, dp, config=wlb.PackerConfig(thresholds=[]))
    return wlb.WLBStream(docs, packer, 512 * n_micro * dp, window=512)


def _trainer_config(**changes):
    from torchtitan.config import ParallelismConfig, TrainingConfig

    spec = tt.small_config("llama3", dim=32, layers=2, vocab=97)

    class Spec:  # only the fields check_trainer_config reads
        model = spec

    base = dict(model_spec=Spec(), dataloader=tt.WLBDataLoader.Config(stream=_stream()),
                training=TrainingConfig(local_batch_size=2, seq_len=512),
                parallelism=ParallelismConfig(spmd_backend="partial_dtensor"))
    training = changes.pop("training", {})
    parallelism = changes.pop("parallelism", {})
    base["training"] = dataclasses.replace(base["training"], **training)
    base["parallelism"] = dataclasses.replace(base["parallelism"], **parallelism)
    base.update(changes)
    return tt.WLBTrainer.Config(**base)


def _steps(loader):
    for _ in loader.steps():
        pass


def _within_a_step():
    """A loader resumed from a state saved after the first micro-batch of a step."""
    items = tt.WLBDataLoader(_stream(), local_batch_size=1)
    it = iter(items)
    next(it)
    loader = tt.WLBDataLoader(_stream())
    loader.load_state_dict(items.state_dict())
    return loader


class Qwen35Model:
    """Stands for torchtitan's qwen3_5 (its config module needs the optional `fla` package):
    the adapter recognises a family by its config class, `<Family>Model.Config`
    (`test_every_refused_family_names_a_class_torchtitan_defines` checks the name)."""

    class Config:
        layers: list = []


def _chunked_loss():
    from torchtitan.components.loss import ChunkedLossWrapper

    return ChunkedLossWrapper.Config()


def _validator():
    from torchtitan.components.validate import Validator

    return Validator.Config(enable=True)


def _tied_qwen3():
    """A small qwen3 decoder (built after `use_wlb_attention`) whose LM head is its embedding."""
    config = dataclasses.replace(tt.small_config("qwen3", dim=32, layers=2, vocab=97), enable_weight_tying=True)
    tt.use_wlb_attention(config)
    model = config.build()
    assert model.lm_head.weight is model.tok_embeddings.weight
    return model


def _moe_qwen3():
    return _registry("qwen3", "debugmodel_moe")


CASES = [
    ("family.qwen3_5", lambda: tt.check_family(Qwen35Model.Config()), ValueError, "linear-attention layers"),
    ("family.muse_glimmer", lambda: tt.check_family(_registry("muse_glimmer", "debugmodel")), ValueError,
     "muse_glimmer"),
    ("family.gpt_oss", lambda: tt.check_family(_registry("gpt_oss", "debugmodel")), ValueError, "gpt_oss"),
    ("family.deepseek_v3", lambda: tt.check_family(_registry("deepseek_v3", "debugmodel")), ValueError,
     "deepseek_v3"),
    ("family.unknown", lambda: tt.check_family(object()), ValueError, "not a family wlb-opt knows"),
    ("family.moe", lambda: tt.check_family(_moe_qwen3()), ValueError, "MoE layer"),
    ("spec.moe", lambda: wlb.ModelSpec.from_torchtitan(_moe_qwen3()), ValueError, "MoE layer"),
    ("use_wlb_attention.moe", lambda: tt.use_wlb_attention(_moe_qwen3()), ValueError, "MoE layer"),
    ("titan_stages.pp", lambda: tt.titan_stages(None, 0), ValueError, "pp must be an integer >= 1, got 0"),
    ("titan_stages.virtual", lambda: tt.titan_stages(None, 1, True), ValueError,
     "virtual_stages must be an integer >= 1, got True"),
    ("stage_bounds.too_many", lambda: tt.stage_bounds(2, 3), ValueError, "cannot split 2 layers into 3 stages"),
    ("small_config.family", lambda: tt.small_config("gpt_oss"), ValueError, "family must be one of"),
    ("loader.stream", lambda: tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=[1, 2])), ValueError,
     "must be a wlb_opt.WLBStream, got list"),
    ("loader.dp_mismatch", lambda: tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=_stream(dp=2)), dp_world_size=1),
     ValueError, "plans dp=2 replicas but the trainer has a DP degree (dp_replicate x dp_shard) of 1"),
    ("loader.seq_len", lambda: _steps(tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=_stream()), seq_len=256)),
     ValueError, "past training.seq_len=256"),
    ("loader.stock_seq_len", lambda: list(tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=_stream()),
                                                             seq_len=256, local_batch_size=1)),
     ValueError, "reaches position 299 (piece at offset 0, 300 tokens), past training.seq_len=256"),
    ("loader.done_negative", lambda: tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=_stream())).load_state_dict(
        {**tt.WLBDataLoader(_stream()).state_dict(), tt.DONE_KEY: -1}), ValueError,
     "'wlb_stream_micro_batches_done' must be an integer in [0, n_micro) = [0, 2)"),
    ("loader.done_whole_step", lambda: tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=_stream())).load_state_dict(
        {**tt.WLBDataLoader(_stream()).state_dict(), tt.DONE_KEY: 2}), ValueError,
     "handed out), got 2"),
    ("titan_stages.tied_pp", lambda: tt.titan_stages(_tied_qwen3(), 2), ValueError,
     "ties its LM head to its embeddings (enable_weight_tying=True); with pp=2"),
    ("loader.steps_within_a_step", lambda: _steps(_within_a_step()), ValueError,
     "the loaded state is within a step (1 of its micro-batches handed out through the iterator)"),
    ("trainer.cp_mismatch", lambda: tt.check_trainer_config(_trainer_config(
        parallelism={"context_parallel_degree": 2})), ValueError,
     "the stream shards each micro-batch for cp=1 ranks but parallelism.context_parallel_degree is 2"),
    ("loader.stock_batch", lambda: next(iter(tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=_stream()),
                                                                local_batch_size=4))),
     ValueError, "training.local_batch_size=1 (got 4)"),
    ("loader.load_state", lambda: tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=_stream())).load_state_dict(
        {"dp_rank_0": b""}), ValueError, "no 'wlb_stream' in the checkpoint's dataloader state"),
    ("trainer.loader", lambda: tt.check_trainer_config(_trainer_config(dataloader=object())), ValueError,
     "WLBTrainer needs dataloader=WLBDataLoader.Config(stream=...)"),
    ("trainer.no_stream", lambda: tt.check_trainer_config(_trainer_config(
        dataloader=tt.WLBDataLoader.Config())), ValueError, "stream is None"),
    ("trainer.n_micro", lambda: tt.check_trainer_config(_trainer_config(training={"local_batch_size": 8})),
     ValueError, "training.local_batch_size=8 must equal the packer's n_micro=2"),
    ("trainer.accumulation", lambda: tt.check_trainer_config(_trainer_config(training={"global_batch_size": 16})),
     ValueError, "leave training.global_batch_size at -1"),
    ("trainer.spmd_backend", lambda: tt.check_trainer_config(_trainer_config(
        parallelism={"spmd_backend": "spmd_types"})), ValueError, "spmd_backend='spmd_types' is not supported"),
    ("trainer.sequence_parallel", lambda: tt.check_trainer_config(_trainer_config(
        parallelism={"tensor_parallel_degree": 2, "enable_sequence_parallel": True})), ValueError,
     "enable_sequence_parallel"),
    ("trainer.expert_parallel", lambda: tt.check_trainer_config(_trainer_config(
        parallelism={"expert_parallel_degree": 2})), ValueError, "expert parallelism is not supported"),
    ("trainer.chunked_loss", lambda: tt.check_trainer_config(_trainer_config(loss=_chunked_loss())), ValueError,
     "leave loss at CrossEntropyLoss.Config(), got ChunkedLossWrapper.Config"),
    ("trainer.validator", lambda: tt.check_trainer_config(_trainer_config(validator=_validator())), ValueError,
     "validator.enable"),
    ("trainer.layer_split", lambda: tt.check_trainer_config(_trainer_config(
        parallelism={"pipeline_parallel_layers_per_stage": 1})), ValueError,
     "leave parallelism.pipeline_parallel_layers_per_stage at None"),
    ("trainer.virtual_stages", lambda: tt.check_trainer_config(_trainer_config(virtual_stages=0)), ValueError,
     "virtual_stages must be an integer >= 1, got 0"),
    # torchtitan's pipelining function, which reads it, runs only with PP
    ("trainer.virtual_stages_without_pp", lambda: tt.check_trainer_config(_trainer_config(virtual_stages=2)),
     ValueError, "virtual_stages=2 needs pp >= 2"),
    ("trainer.interleaved_n_micro", lambda: tt.check_trainer_config(_trainer_config(
        virtual_stages=2, parallelism={"pipeline_parallel_degree": 4},
        training={"disable_cuda_graphs": True})), ValueError,
     "the interleaved schedule needs n_micro to be a multiple of pp=4, got n_micro=2"),
    *[(f"trainer.tp_with_{kind}", (lambda kind=kind: tt.check_trainer_config(_trainer_config(
        parallelism={"tensor_parallel_degree": 2, "enable_sequence_parallel": False,
                     f"data_parallel_{kind}_degree": 2}))), ValueError,
       "tensor_parallel_degree=2 with 2 data-parallel replicas is not supported") for kind in ("replicate", "shard")],
    ("attention.no_boundaries", lambda: tt.WLBAttention()(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4),
                                                          torch.zeros(1, 2, 1, 4)), ValueError,
     "needs the micro-batch's document boundaries"),
]


@pytest.mark.parametrize("call, exc_type, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_torchtitan_input_raises_a_clear_error(call, exc_type, fragment):
    _check(call, exc_type, fragment)


def test_every_refused_family_names_a_class_torchtitan_defines():
    """The refusals are keyed on torchtitan's class names: each must be a model class of the
    installed torchtitan (read from its sources: qwen3_5's module needs the optional `fla`)."""
    import re
    from pathlib import Path

    import torchtitan.models

    root = Path(torchtitan.models.__file__).parent
    defined = {m.group(1) for path in root.rglob("*.py") for m in re.finditer(r"^class (\w+)\(", path.read_text(),
                                                                                 re.MULTILINE)}
    assert set(tt._REFUSED) <= defined, sorted(set(tt._REFUSED) - defined)
