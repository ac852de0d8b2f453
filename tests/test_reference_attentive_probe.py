"""octfw's attentive probe against V-JEPA 2's AttentiveClassifier on the same weights and tokens
(tests/fixtures/reference/attentive_probe.{json,safetensors}, from tools/parity/attentive_probe.py).

The reference's weights go into octfw's probe module (:class:`octfw.evaluation.attentive.AttentiveHead`,
one member of the attentive-probe grid and fine-tuning's head), mapped one by one:

- ``query_tokens`` -> ``query``; ``norm1``/``norm2`` -> ``ln1``/``ln2``; ``mlp.fc1``/``fc2`` ->
  ``w_1``/``w_2``; ``linear`` -> ``w_c``; a Linear's ``[out, in]`` weight is octfw's ``[in, out]``;
- ``xattn.kv``'s first ``E`` outputs are the keys, the next ``E`` the values (heads contiguous);
  the key bias is dropped: it adds the same score to every token, which the softmax removes;
- octfw's output projection ``w_o``, ``b_o``, which the reference does not have, is set to the
  identity and 0 (docs/reference-parity.md#attentive-probe);
- octfw's channel standardisation (its own addition) is left at its identity, mean 0, scale 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from octfw.evaluation.attentive import AttentiveHead, layout

FIXTURES = Path(__file__).parent / "fixtures" / "reference"
RECORDED = json.loads((FIXTURES / "attentive_probe.json").read_text())
TENSORS = load_file(str(FIXTURES / "attentive_probe.safetensors"))
WIDTH, HEADS, CLASSES = (RECORDED["module"][k] for k in ("embed_dim", "num_heads", "num_classes"))


def octfw_parameters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    block = "pooler.cross_attention_block."
    kv_w, kv_b = state[block + "xattn.kv.weight"], state[block + "xattn.kv.bias"]
    return {
        "query": state["pooler.query_tokens"][0],
        "ln1_w": state[block + "norm1.weight"], "ln1_b": state[block + "norm1.bias"],
        "w_q": state[block + "xattn.q.weight"].T, "b_q": state[block + "xattn.q.bias"],
        "w_k": kv_w[:WIDTH].T,
        "w_v": kv_w[WIDTH:].T, "b_v": kv_b[WIDTH:],
        "w_o": torch.eye(WIDTH), "b_o": torch.zeros(WIDTH),
        "ln2_w": state[block + "norm2.weight"], "ln2_b": state[block + "norm2.bias"],
        "w_1": state[block + "mlp.fc1.weight"].T, "b_1": state[block + "mlp.fc1.bias"],
        "w_2": state[block + "mlp.fc2.weight"].T, "b_2": state[block + "mlp.fc2.bias"],
        "w_c": state["linear.weight"].T, "b_c": state["linear.bias"],
    }


def loaded_head(state: dict[str, torch.Tensor]) -> AttentiveHead:
    head = AttentiveHead(WIDTH, CLASSES, HEADS, torch.Generator().manual_seed(0))
    mapped = octfw_parameters(state)
    assert set(mapped) == set(layout(WIDTH, CLASSES))  # every octfw parameter is set
    with torch.no_grad():
        for name, value in mapped.items():
            head.params[name].copy_(value)
    return head


def reference_state() -> dict[str, torch.Tensor]:
    return {key[len("state/"):]: value for key, value in TENSORS.items() if key.startswith("state/")}


def test_the_fixture_names_the_reference_commit_and_every_key_is_mapped():
    assert RECORDED["reference"]["repo"].endswith("facebookresearch/vjepa2")
    assert len(RECORDED["reference"]["commit"]) == 40
    state = reference_state()
    assert sorted(state) == RECORDED["state_keys"]
    # Every reference tensor is used except the key bias (which the softmax cancels).
    assert RECORDED["module"]["depth"] == 1 and RECORDED["module"]["qkv_bias"]


def test_the_probe_with_the_reference_weights_gives_its_logits_within_1e5():
    head = loaded_head(reference_state())
    with torch.no_grad():
        logits = head(TENSORS["tokens"])
    assert logits.shape == TENSORS["logits"].shape
    torch.testing.assert_close(logits, TENSORS["logits"], rtol=0, atol=1e-5)


def test_the_key_bias_is_cancelled_by_the_softmax_and_the_value_bias_is_not():
    # Why dropping the reference's key bias is exact: the recorded weights have a key bias of
    # size ~0.3, and the logits match without it (above); a changed value bias moves them.
    state = reference_state()
    bias = state["pooler.cross_attention_block.xattn.kv.bias"]
    assert bias[:WIDTH].abs().max() > 0.1
    shifted = dict(state)
    shifted["pooler.cross_attention_block.xattn.kv.bias"] = bias + torch.cat(
        [torch.zeros(WIDTH), torch.full((WIDTH,), 0.5)])
    with torch.no_grad():
        moved = loaded_head(shifted)(TENSORS["tokens"])
    assert (moved - TENSORS["logits"]).abs().max() > 1e-2


def test_octfws_output_projection_is_a_difference_the_reference_does_not_have():
    # docs/reference-parity.md: octfw's cross-attention projects the heads' output (w_o); V-JEPA's
    # (1 and 2) adds it to the query unprojected. With any other w_o the outputs part.
    head = loaded_head(reference_state())
    with torch.no_grad():
        head.params["w_o"].mul_(0.5)
        logits = head(TENSORS["tokens"])
    assert (logits - TENSORS["logits"]).abs().max() > 1e-3
