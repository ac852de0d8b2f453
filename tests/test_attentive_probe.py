"""The attentive probe: learned queries over frozen tokens, a grid chosen on validation.

Tokens here are made by hand: a "lesion" is a few consecutive tokens shifted
along one channel, on top of an offset all tokens share (as frozen features
do), so a mean over tokens dilutes it and a query that finds it does not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octfw.plugins.evaluators.attentive_probe.algorithm import fit_attentive_grid, select_member
from octfw.evaluation.classification import Encoded
from octfw.plugins.evaluators.attentive_probe.evaluator import AttentiveProbeEvaluator
from octfw.plugins.evaluators.attentive_probe import AttentiveProbeConfig
from octfw.evaluation.features import LabelledVolumes, pool_tokens, pooled_grid


def _lesions(n: int, seed: int, *, flip: bool = False, tokens: int = 16, width: int = 16):
    """``[n, tokens, width]`` bfloat16 tokens and labels 0/1 (alternating); label 1 carries the
    lesion, or label 0 with ``flip`` (the same signal meaning the opposite)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    x = torch.randn(n, tokens, width, generator=generator) + 3.0
    start = torch.randint(0, tokens - 2, (n,), generator=generator)
    carrier = 1 - labels if flip else labels
    for i in range(n):
        if carrier[i]:
            x[i, start[i]:start[i] + 3, 0] += 3.0
    return x.to(torch.bfloat16), labels


def _fit(x, y, seed=0, val=None, **options):
    options = {"learning_rates": [3e-3, 3e-2], "weight_decays": [0.01], "max_epochs": 20, "patience": 20,
               "batch_size": 16, "num_heads": 4, **options}
    val_x, val_y = _lesions(32, seed=9) if val is None else val
    return fit_attentive_grid(x, y, val_x, val_y, 2, seed=seed, **options)


def test_the_probe_finds_a_small_lesion_far_above_chance():
    train_x, train_y = _lesions(64, seed=0)
    val_x, val_y = _lesions(32, seed=1)
    test_x, test_y = _lesions(200, seed=2)
    grid = _fit(train_x, train_y, val=(val_x, val_y))
    chosen = select_member(grid, val_x, val_y).chosen
    accuracy = float((grid.probabilities(test_x, chosen).argmax(1) == test_y).float().mean())
    assert accuracy >= 0.8  # chance: 0.5


def test_the_grid_is_deterministic_for_a_seed_and_the_seed_matters():
    x, y = _lesions(40, seed=0)
    torch.manual_seed(1)
    first = _fit(x, y, seed=7, max_epochs=8)
    torch.manual_seed(2)  # the global generator plays no part
    torch.rand(5)
    second = _fit(x, y, seed=7, max_epochs=8)
    assert all(torch.equal(first.params[k], second.params[k]) for k in first.params)
    other = _fit(x, y, seed=8, max_epochs=8)
    assert not torch.equal(first.params["query"], other.params["query"])


def test_members_differ_only_by_learning_rate_and_weight_decay():
    x, y = _lesions(32, seed=0)
    # Two identical grid entries train to identical members: same start, same batches.
    grid = _fit(x, y, learning_rates=[1e-2, 1e-2], weight_decays=[0.1])
    assert grid.members == ((1e-2, 0.1), (1e-2, 0.1))
    assert all(torch.equal(grid.params[k][0], grid.params[k][1]) for k in ("query", "w_v", "w_c"))
    alone = _fit(x, y, learning_rates=[1e-2], weight_decays=[0.1])
    # Trained as part of a grid or alone: the same member, to float rounding of the batched products.
    assert torch.allclose(grid.params["w_c"][0], alone.params["w_c"][0], atol=1e-5)


def _evaluator(train, test, **options) -> AttentiveProbeEvaluator:
    config = AttentiveProbeConfig(dataset={"name": "hand-made"}, bootstrap=0, **options)
    evaluator = AttentiveProbeEvaluator(config, None, None, None)

    def volumes(labels):
        n = len(labels)
        return LabelledVolumes(None, None, list(range(n)), np.asarray(labels, dtype=np.int64), ["a"] * n,
                               [f"v{i}" for i in range(n)], None)

    # The split the evaluator would decode from a dataset, given directly.
    evaluator._split = (volumes(train), volumes(test))
    return evaluator


def test_the_member_is_chosen_on_validation_even_where_another_scores_higher_on_test():
    # Train and validation: the lesion means label 1. Test: it means label 0. A member that
    # learned nothing (learning rate 1e-7) scores higher on this test split than the member that
    # learned the lesion; choosing by test would report it. Choosing on validation must not.
    train_x, train_y = _lesions(64, seed=0)
    test_x, test_y = _lesions(60, seed=3, flip=True)
    options = dict(learning_rates=(1e-7, 1e-2), weight_decays=(0.01,), max_epochs=20, num_heads=4, seed=0)
    evaluator = _evaluator(train_y.numpy(), test_y.numpy(), **options)
    metrics = evaluator.score(Encoded(train_x, test_x))
    assert metrics["selected_lr"] == 1e-2 and metrics["val_balanced_accuracy"] > 0.5
    assert metrics["accuracy"] <= 0.3  # the chosen member, measured honestly on the flipped test split

    fit, val = evaluator.fit_val_positions()
    assert not set(fit) & set(val) and len(val) == 16
    grid = fit_attentive_grid(train_x[fit], train_y[fit], train_x[val], train_y[val], 2, learning_rates=[1e-7, 1e-2],
                              weight_decays=[0.01], max_epochs=20, patience=40, batch_size=16, num_heads=4, seed=0)
    on_test = [float((member.argmax(1) == test_y).float().mean()) for member in grid.logits(test_x)]
    assert on_test[0] > on_test[1] and on_test[1] == pytest.approx(metrics["accuracy"])


def test_the_score_is_the_same_twice():
    train_x, train_y = _lesions(48, seed=0)
    test_x, test_y = _lesions(30, seed=1)
    evaluator = _evaluator(train_y.numpy(), test_y.numpy(), learning_rates=(1e-2,), weight_decays=(0.01, 0.1),
                           max_epochs=10, num_heads=4)
    encoded = Encoded(train_x, test_x)
    assert evaluator.score(encoded) == evaluator.score(encoded)


def test_tokens_are_pooled_over_grid_cells_to_a_bounded_count():
    assert pooled_grid((32, 16, 16), 64) == (4, 4, 4)
    assert pooled_grid((4, 4, 4), 64) == (4, 4, 4)
    assert pooled_grid((3, 5, 7), 10) == (2, 2, 2)
    grid = (8, 4, 4)
    tokens = torch.randn(2, 8 * 4 * 4, 3)
    assert pooled_grid(grid, 16) == (2, 2, 4)  # (8, 4, 4) -> (4, 4, 4) -> (2, 4, 4) -> (2, 2, 4)
    pooled = pool_tokens(tokens, grid, 16)
    assert pooled.shape == (2, 16, 3)
    # Row-major tokens: the first pooled token is the mean of the patches (0-3, 0-1, 0).
    cube = tokens.reshape(2, 8, 4, 4, 3)[:, :4, :2, :1].reshape(2, -1, 3).mean(dim=1)
    assert torch.allclose(pooled[:, 0], cube, atol=1e-6)
    assert pool_tokens(tokens, grid, 128) is not None and pool_tokens(tokens, grid, 128).shape == tokens.shape
    # Without a grid: runs of consecutive tokens.
    assert pool_tokens(tokens, None, 16).shape == (2, 16, 3)


def test_a_width_the_heads_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        _fit(torch.randn(8, 4, 10), torch.arange(8) % 2, num_heads=4)


def _grid_of(informative: list[bool], biases: list[list[float]], width: int = 4):
    """A grid whose members read channel 0 of the mean normalised token (zero query: uniform
    attention; value and output projections the identity; no MLP), or ignore the tokens
    (``informative`` False) and answer with their classifier bias alone."""
    from octfw.evaluation.attentive import layout
    from octfw.plugins.evaluators.attentive_probe.algorithm import AttentiveProbeGrid

    members = len(biases)
    params = {name: torch.zeros(members, *shape) for name, shape in layout(width, 2).items()}
    for name in ("ln1_w", "ln2_w"):
        params[name] += 1.0
    for name in ("w_v", "w_o"):
        params[name] = torch.eye(width).expand(members, -1, -1).clone()
    for member, reads in enumerate(informative):
        if reads:
            params["w_c"][member, 0, 1], params["w_c"][member, 0, 0] = 1.0, -1.0  # class 1: channel 0 high
    params["b_c"] = torch.tensor(biases)
    return AttentiveProbeGrid({**params, "mean": torch.zeros(width), "scale": torch.ones(width)}, 1,
                              tuple((1e-3, 0.0) for _ in biases))


def _one_channel_tokens(values: list[float], width: int = 4):
    x = torch.zeros(len(values), 3, width)
    x[:, :, 0] = torch.tensor(values)[:, None]
    x[:, :, 1] = torch.arange(len(values), dtype=torch.float32)[:, None] % 3  # layer norm needs spread
    return x


def test_a_member_that_predicts_one_class_is_never_chosen_while_another_is_left():
    # Member 0 reads the signal and commits to its answers; on this small validation split it
    # gets one volume of each class right: balanced accuracy 0.5, and its two confident
    # mistakes cost cross-entropy. Member 1 answers class 0 whatever it sees (a bias, no
    # weights): also 0.5, at about ln 2. The old tie-break (lower loss) picked member 1.
    val_x = _one_channel_tokens([2.0, -2.0, 2.0, -2.0])
    val_y = torch.tensor([1, 1, 0, 0])
    grid = _grid_of([True, False], [[0.0, 0.0], [0.1, 0.0]])
    selection = select_member(grid, val_x, val_y)
    assert selection.single_class == [False, True]
    assert selection.balanced_accuracy == [0.5, 0.5]
    assert selection.loss[1] < selection.loss[0]
    assert selection.chosen == 0 and not selection.degenerate


def test_a_grid_where_every_member_predicts_one_class_is_flagged_and_warned_about(caplog):
    # Tokens without any signal (all zero) and a three-to-one class balance: every member
    # learns the prior and nothing else, so each answers class 0 for every validation volume.
    labels = np.array([0, 0, 0, 1] * 16)
    tokens = torch.zeros(len(labels), 4, 8)
    evaluator = _evaluator(labels, labels[:8], learning_rates=(1e-3, 1e-2), weight_decays=(0.0,), num_heads=2,
                           max_epochs=4, seed=0)
    with caplog.at_level("WARNING", logger="octfw.evaluation.classification"):
        metrics = evaluator.score(Encoded(tokens, tokens[:8]))
    assert metrics["single_class"] == 1.0 and metrics["single_class_members"] == 2.0
    assert "every member of the grid predicts one class for all 16 validation volumes" in caplog.text


# Not the lesion task: from a few dozen labelled volumes the attentive probe memorises before it
# reads a small finding (issue #39's sample need, benchmarks/learning/attentive_sample_need.py). From
# 60 training volumes it read the lesion at 0.42 (interval up to 0.57) on an AVX2 CPU against the
# token linear probe's 0.76, and cleared the rule on AVX-512 CPUs by rounding: a check that passes or
# fails by the CPU, not by the probe.
@pytest.mark.slow
def test_where_the_linear_probe_beats_chance_on_fluid_the_attentive_probe_is_not_worse_beyond_the_intervals(
        tmp_path, capsys):
    """Issue #29's rule, on the synthetic fluid task and the tiny encoder `octfw eval` compares against
    (randomly initialised, seed 0): where the linear probe's AUROC interval clears chance, the
    attentive probe's interval reaches at least the linear probe's AUROC (bootstrap 95 %, 120
    volumes, half of them test; the evaluators give intervals for AUROC and AUPRC)."""
    import json
    import textwrap

    from octfw.cli.main import main
    from octfw.exports.formats import encoder_info
    from octfw.exports.writing import write_export
    from octfw.models.vit3d import ViT3DEncoder

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        encoder = ViT3DEncoder((16, 64, 64), (4, 16, 16), 1, 96, 4, 3, 4.0)  # vjepa3d "tiny"
    recipe = {"transform": {"name": "oct-standard", "image_size": [16, 64, 64]}, "model": {"name": "vjepa3d"}}
    export = tmp_path / "encoder.pt"
    write_export("octfw", export, encoder, encoder_info(encoder.architecture(), recipe, "hand-made", 0, {}))
    dataset = '{ name = "synthetic-oct", n_volumes = 120, labels = true, seed = 1, task = "fluid" }'
    eval_recipe = tmp_path / "eval.toml"
    eval_recipe.write_text(textwrap.dedent(f"""
        [run]
        device = "cpu"

        [[evaluator]]
        name = "linear-probe"
        dataset = {dataset}
        bootstrap = 200

        [[evaluator]]
        name = "attentive-probe"
        dataset = {dataset}
        bootstrap = 200
    """), encoding="utf-8")
    assert main(["eval", str(export), "--recipe", str(eval_recipe), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)["pretrained"]  # the exported (random) encoder
    # The linear probe's stronger reading, on the tokens (since issue #39; with the patch projection
    # initialised as a linear layer the mean of the tokens no longer clears chance on these tasks).
    linear_low = scores["linear-probe/tokens_auroc_ci_low"]
    assert linear_low > 0.5, f"the linear probe does not beat chance here ({linear_low:.3f}); the rule is void"
    assert scores["attentive-probe/auroc_ci_high"] >= scores["linear-probe/tokens_auroc"]
    assert scores["attentive-probe/single_class"] == 0.0


def test_the_probe_is_v_jepas_cross_attention_block_computed_without_a_member_token_width_tensor():
    # The same parameters through the textbook order of operations (keys and values of every
    # token, a key bias, scaled dot-product attention, residual and MLP) give the same logits.
    from octfw.evaluation.attentive import attentive_forward, initial_parameters

    width, heads, classes = 8, 2, 3
    params = {name: value + 0.3 * torch.randn(value.shape, generator=torch.Generator().manual_seed(i))
              for i, (name, value) in enumerate(initial_parameters(width, classes,
                                                                   torch.Generator().manual_seed(0)).items())}
    tokens = torch.randn(5, 7, width) * 2 + 1
    stats = {"mean": tokens.reshape(-1, width).mean(0), "scale": tokens.reshape(-1, width).std(0, correction=0)}
    got = attentive_forward({**{k: v[None] for k, v in params.items()}, **stats}, tokens, heads)[0]

    p = params
    x = torch.nn.functional.layer_norm((tokens - stats["mean"]) / stats["scale"], (width,), p["ln1_w"], p["ln1_b"])
    query = (p["query"] @ p["w_q"] + p["b_q"]).expand(5, -1, -1)  # [B, 1, E]
    keys = x @ p["w_k"] + torch.randn(width)  # any key bias: the softmax removes it
    values = x @ p["w_v"] + p["b_v"]
    split = lambda t: t.reshape(5, t.shape[1], heads, width // heads).transpose(1, 2)
    attended = torch.nn.functional.scaled_dot_product_attention(split(query), split(keys), split(values))
    hidden = p["query"] + attended.transpose(1, 2).reshape(5, 1, width) @ p["w_o"] + p["b_o"]
    inner = torch.nn.functional.layer_norm(hidden, (width,), p["ln2_w"], p["ln2_b"]) @ p["w_1"] + p["b_1"]
    hidden = hidden + torch.nn.functional.gelu(inner) @ p["w_2"] + p["b_2"]
    expected = (hidden @ p["w_c"] + p["b_c"])[:, 0]
    assert torch.allclose(got, expected, atol=1e-5)


def test_training_stops_when_validation_stops_improving_and_keeps_the_best_epoch():
    from octfw.plugins.evaluators.attentive_probe.algorithm import validation_scores

    x, y = _lesions(48, seed=0)
    val = _lesions(32, seed=9)
    grid = _fit(x, y, val=val, learning_rates=[1e-2], max_epochs=400, patience=5)
    assert grid.epochs_trained < 400  # stopped by patience, not the cap
    assert grid.epochs_trained - grid.best_epoch[0] >= 5
    longer = _fit(x, y, val=val, learning_rates=[1e-2], max_epochs=400, patience=grid.epochs_trained + 400)
    assert longer.epochs_trained == 400
    # What is returned is the best epoch's network: its validation score is the best recorded.
    kept, _, _ = validation_scores(grid.logits(val[0]), val[1])
    assert kept[0] == grid.best_balanced_accuracy[0] > 0.7
