"""The Hugging Face adapter against transformers' own forward (sdpa, one piece at a time).

Models are built from small configs (nothing downloaded), in fp64. Distributed cases spawn
2 and 4 gloo ranks; each plans the same `WLBStream` and trains one step through
`split_hf_stages` + `train_step`, then compares the loss and every gradient it holds with
the single-process reference.
"""
from __future__ import annotations

import copy
import re
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


import wlb_opt as wlb  # noqa: E402
from wlb_opt.integrations import hf  # noqa: E402

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**SIZES)
    if family == "qwen2":
        return transformers.Qwen2Config(**SIZES, use_sliding_window=False)
    if family == "granite":  # a softmax scale that is not 1/sqrt(head_dim), and the other multipliers
        return transformers.GraniteConfig(**SIZES, attention_multiplier=0.3, embedding_multiplier=2.0,
                                          residual_multiplier=0.5, logits_scaling=4.0)
    if family == "cohere":  # logits * logit_scale after the head
        return transformers.CohereConfig(**SIZES, logit_scale=0.25)
    raise ValueError(family)


def models(family: str, seed: int = 0):
    """(the model with attn_implementation="wlb", the same weights with "sdpa")."""
    hf.register()
    cfg = config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="wlb",
                                                          dtype=torch.float64)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                                                        dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    return model, ref


def documents(n: int = 14, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = [1, 70] + rng.integers(2, 40, n - 2).tolist()  # a piece of length 1, a document cut in pieces
    return [(10 + i, rng.integers(0, SIZES["vocab_size"], k)) for i, k in enumerate(lengths)]


def first_step(dp: int, cp: int, pp: int):
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(dp=dp, cp=cp, pp=pp),
                                  wlb.HardwareSpec.preset("cpu"))
    packer = wlb.WLBPacker(2 * pp, 64, cost, config=wlb.PackerConfig(thresholds=[]))
    stream = wlb.WLBStream(documents(), packer, 64 * 2 * pp * dp, window=32, strategy="hybrid" if cp > 1 else "adaptive")
    return next(iter(stream))


def reference(ref, step):
    """HF's own path: each piece alone, position_ids = offset + arange(length), the loss summed
    and divided by the global batch's target count."""
    plan, total = step.plan, step.target_tokens
    loss_sum = 0.0
    for mb in plan.micro_batches:
        for i in mb:
            n, off = int(plan.lengths[i]), int(plan.offsets[i])
            tokens, _ = step.piece(int(plan.doc_ids[i]), off, n)
            tokens = torch.as_tensor(tokens)
            if n < 2:
                continue
            logits = ref(tokens[None], position_ids=(off + torch.arange(n))[None]).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum") / total
            loss.backward()
            loss_sum += float(loss.detach())
    return loss_sum, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------- one process
@pytest.mark.parametrize("family", ["llama", "qwen2", "granite"])
def test_the_models_own_packed_forward_equals_one_document_at_a_time(family):
    model, ref = models(family)
    lengths = [5, 1, 12, 7]
    ids = torch.randint(0, SIZES["vocab_size"], (sum(lengths),))
    pos = torch.cat([torch.arange(n) for n in lengths])
    packed = model(ids[None], position_ids=pos[None]).logits[0]
    starts = np.cumsum([0] + lengths)
    alone = torch.cat([ref(ids[None, a:b], position_ids=torch.arange(b - a)[None]).logits[0]
                       for a, b in zip(starts[:-1], starts[1:])])
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "granite", "cohere"])
def test_one_process_train_step_through_the_adapter_equals_hf(family):
    model, ref = models(family)
    step = first_step(1, 1, 1)
    stage = hf.split_hf_stages(model, 1)[0]
    from wlb_opt.executor import train_step

    loss = train_step(stage, step.plan, step.shards, data=step, backend="torch")
    ref_loss, ref_grads = reference(ref, step)
    assert abs(loss - ref_loss) < 1e-10
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-8, atol=1e-10, msg=lambda m: f"{name}: {m}")


def _piece_loss_sum(ref, tokens_of_pieces) -> float:
    """HF's own loss summed over pieces, each alone with position_ids = offset + arange."""
    total = 0.0
    for tokens, off in tokens_of_pieces:
        n = len(tokens)
        if n > 1:
            lg = ref(tokens[None], position_ids=(off + torch.arange(n))[None]).logits[0]
            total += float(torch.nn.functional.cross_entropy(lg[:-1], tokens[1:], reduction="sum").detach())
    return total


def _sequence_starts(position_ids) -> np.ndarray:
    """Where transformers (and attn_implementation="wlb") start a sequence in a packed row."""
    pos = position_ids.reshape(-1).numpy()
    return np.flatnonzero(np.concatenate([[True], pos[1:] != pos[:-1] + 1]))


def test_hf_batch_gives_transformers_labels_and_the_same_loss():
    model, ref = models("llama")
    step = first_step(1, 1, 1)
    j = next(j for j, mb in enumerate(step.plan.micro_batches) if len(mb) > 1)
    batch = hf.hf_batch(step, j)
    mb = step.plan.micro_batches[j]
    # every piece is its own sequence, labelled -100 at its first token
    starts = _sequence_starts(batch["position_ids"])
    assert len(starts) == len(mb) and (batch["labels"][0, starts] == -100).all()
    assert int((batch["labels"] != -100).sum()) == int((step.inputs(j)["labels"] != -100).sum())
    out = model(**batch)
    pieces = [(torch.as_tensor(step.piece(int(step.plan.doc_ids[i]), int(step.plan.offsets[i]),
                                          int(step.plan.lengths[i]))[0]), int(step.plan.offsets[i])) for i in mb]
    n_targets = sum(len(t) - 1 for t, _ in pieces)
    loss = _piece_loss_sum(ref, pieces) / n_targets
    # transformers' loss upcasts the logits to fp32, so agreement is to fp32 precision
    assert abs(float(out.loss.detach()) - loss) < 1e-5 * abs(loss)


@pytest.mark.parametrize("ids, offsets", [([7, 7], [0, 32]),    # two pieces of one document, in order
                                          ([7, 8], [0, 32]),    # another document's piece continues the positions
                                          ([7, 8, 7], [0, 0, 32])])
def test_hf_batch_keeps_pieces_apart_whose_positions_would_continue(ids, offsets):
    from types import SimpleNamespace

    model, ref = models("llama")
    lengths = np.array([32, 12, 6][:len(ids)])
    rng = np.random.default_rng(3)
    pieces = [torch.as_tensor(rng.integers(0, SIZES["vocab_size"], n)) for n in lengths]
    plan = SimpleNamespace(micro_batches=[np.arange(len(ids))], lengths=lengths, offsets=np.array(offsets))
    step = SimpleNamespace(plan=plan, tokens=lambda j: torch.cat(pieces))
    batch = hf.hf_batch(step, 0)
    starts = _sequence_starts(batch["position_ids"])
    assert len(starts) == len(ids) and (batch["labels"][0, starts] == -100).all()
    # flash attention's explicit boundaries name the same starts
    assert batch["cu_seq_lens_q"].tolist() == starts.tolist() + [int(lengths.sum())] == batch["cu_seq_lens_k"].tolist()
    assert batch["max_length_q"] == batch["max_length_k"] == int(lengths.max())
    loss = _piece_loss_sum(ref, list(zip(pieces, offsets))) / int(sum(lengths - 1))
    # "wlb" (segments from cu_seq_lens_q) and transformers' own sdpa (from position_ids, no cache)
    assert abs(float(model(**batch).loss.detach()) - loss) < 1e-5 * abs(loss)
    assert abs(float(ref(**batch).loss.detach()) - loss) < 1e-5 * abs(loss)
    # "wlb" without the explicit boundaries reads the same starts from position_ids
    plain = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    assert abs(float(model(**plain).loss.detach()) - loss) < 1e-5 * abs(loss)


def test_to_hf_labels_of_an_empty_row_and_bad_boundaries():
    assert hf.to_hf_labels(torch.zeros(0, dtype=torch.long), []).numel() == 0
    model, _ = models("llama")
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.arange(8)[None],
             "cu_seq_lens_q": torch.tensor([0, 5], dtype=torch.int32)}
    with pytest.raises(ValueError, match="cu_seq_lens_q must rise strictly from 0 to the row's 8 tokens"):
        model(**batch)
    # an empty sequence (flash attention's boundaries may hold one) is named as such
    for bounds in ([0, 3, 3, 8], [0, 3, 8, 8]):
        batch["cu_seq_lens_q"] = torch.tensor(bounds, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"cu_seq_lens_q must rise strictly .* \(no empty sequence\), got "
                                             + re.escape(str(bounds))):
            model(**batch)


def test_unsupported_models_and_inputs_are_clear_errors():
    model, ref = models("llama")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        hf.split_hf_stages(ref, 1)
    with pytest.raises(ValueError, match="cannot split 4 decoder layers into 8 stages"):
        hf.split_hf_stages(model, 4, 2)
    with pytest.raises(ValueError, match="batch of one row"):
        model(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="causal LM with"):
        hf.split_hf_stages(torch.nn.Linear(2, 2), 1)
    qwen = transformers.Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    swa = transformers.AutoModelForCausalLM.from_config(qwen, attn_implementation="wlb", dtype=torch.float64)
    with pytest.raises(ValueError, match="sliding-window"):
        swa(torch.zeros(1, 5, dtype=torch.long))
    capped = copy.deepcopy(config("llama"))
    capped.attn_logit_softcapping = 30.0
    soft = transformers.AutoModelForCausalLM.from_config(capped, attn_implementation="wlb", dtype=torch.float64)
    with pytest.raises(ValueError, match="soft-capping"):
        hf.split_hf_stages(soft, 1)


# ---------------------------------------------------------------------- distributed
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (family, dp, cp, pp, tp, fsdp) per world size
CASES = {2: [("llama", 1, 2, 1, 1, False), ("llama", 1, 1, 2, 1, False), ("granite", 1, 2, 1, 1, False),
             ("llama", 1, 1, 1, 2, False), ("qwen2", 1, 1, 1, 2, False), ("granite", 1, 1, 1, 2, False),
             ("cohere", 1, 1, 1, 2, False)],  # each attention / MLP class TP accepts
         4: [("llama", 1, 2, 2, 1, False), ("qwen2", 1, 2, 2, 1, False), ("llama", 2, 2, 1, 1, True)]}


