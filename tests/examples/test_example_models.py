"""In-process checks of the example models and the pure parts of the example scripts (no ranks)."""
from __future__ import annotations

import pytest
import torch

from torch_thunderbolt.testing.models import llama, vit

from .helpers import load_example

CommTimer, median = load_example("models.launch").CommTimer, load_example("models.launch").median


@pytest.fixture(scope="module")
def tiny():
    cfg = llama.make_config("tiny")
    return cfg, llama.build_stage(cfg, range(cfg.layers), True, True, seed=5)


def prompt(batch: int, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("layers,stages,expected", [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]),
                                                    (3, 3, [1, 1, 1]), (4, 1, [4])])
def test_split_layers_covers_every_layer_once(layers, stages, expected):
    ranges = llama.split_layers(layers, stages)
    assert [len(r) for r in ranges] == expected
    assert [i for r in ranges for i in r] == list(range(layers))


def test_split_layers_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot split 2 layers over 3 stages"):
        llama.split_layers(2, 3)


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="multiple of heads"):
        llama.make_config("tiny", hidden=66)
    with pytest.raises(ValueError, match="unknown preset"):
        llama.make_config("huge")


def test_param_count_matches_built_model(tiny):
    cfg, model = tiny
    assert cfg.param_count() == sum(p.numel() for p in model.parameters())


def test_kv_cache_decoding_equals_recomputing_the_whole_sequence(tiny):
    cfg, model = tiny
    p = prompt(2)
    cached = llama.greedy_generate(model, p, 8)
    seq = p
    for _ in range(8):
        logits = model(seq, model.new_caches(2), 0)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, seq[:, p.shape[1]:])


def test_stages_built_separately_equal_the_whole_model(tiny):
    cfg, model = tiny
    a = llama.build_stage(cfg, range(0, 3), True, False, seed=5)
    b = llama.build_stage(cfg, range(3, 4), False, True, seed=5)
    p = prompt(3)
    split = b(a(p, a.new_caches(3), 0), b.new_caches(3), 0)
    assert torch.equal(split, model(p, model.new_caches(3), 0))


def test_other_seed_gives_other_weights(tiny):
    cfg, model = tiny
    other = llama.build_stage(cfg, range(cfg.layers), True, True, seed=6)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_checkpoint_loading_selects_and_renumbers_layers(tiny):
    cfg, model = tiny
    stage = llama.build_stage(cfg, [2, 3], False, True, seed=99, checkpoint=model.state_dict())
    assert torch.equal(stage.layers[0].mlp.up_proj.weight, model.layers[2].mlp.up_proj.weight)
    assert torch.equal(stage.lm_head.weight, model.lm_head.weight)
    assert stage.embed is None


def test_shared_stage_reuses_tensors_without_copy(tiny):
    cfg, model = tiny
    stage = llama.share_stage(model, [0, 1], True, False)
    assert stage.layers[1].attn.q_proj.weight.data_ptr() == model.layers[1].attn.q_proj.weight.data_ptr()
    assert stage.lm_head is None and stage.first and not stage.last


def test_sequence_longer_than_max_seq_is_refused(tiny):
    cfg, model = tiny
    with pytest.raises(ValueError, match="exceeds max_seq"):
        model(prompt(1, cfg.max_seq + 1), model.new_caches(1), 0)


def test_single_stage_decode_equals_greedy_generate(tiny):
    pi = load_example("pipeline_inference")

    cfg, model = tiny
    p = prompt(4)
    res = pi.decode(model, 0, 1, p, pi.DecodeSpec(4, p.shape[1], 7), torch.device("cpu"), CommTimer())
    assert torch.equal(res["tokens"], llama.greedy_generate(model, p, 7))
    assert res["ms_per_token"] > 0


def test_vit_presets_have_the_published_sizes():
    assert 86.0e6 < vit.param_count(vit.make_config("base")) < 87.0e6  # ViT-B/16: 86.6 M
    assert 21.5e6 < vit.param_count(vit.make_config("small")) < 22.5e6  # ViT-S/16: 22 M


def test_vit_forward_shape_and_bad_image_size():
    cfg = vit.make_config("tiny")
    out = vit.ViT(cfg)(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, cfg.classes)
    with pytest.raises(ValueError, match="multiple of patch"):
        vit.make_config("tiny", image_size=40)


def test_synthetic_images_are_deterministic_and_differ_per_rank():
    data = vit.SyntheticImages(vit.make_config("tiny"), seed=1)
    x0, y0 = data.batch(4, rank=0, step=2)
    x0b, y0b = data.batch(4, rank=0, step=2)
    x1, _ = data.batch(4, rank=1, step=2)
    assert torch.equal(x0, x0b) and torch.equal(y0, y0b)
    assert not torch.equal(x0, x1)


def test_comm_recorder_counts_overlapping_buckets_once():
    train_vit = load_example("train_vit")

    rec = train_vit.CommRecorder()
    rec.intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]
    assert rec.take_busy_seconds() == pytest.approx(4.0)
    assert rec.take_busy_seconds() == 0.0


def test_int8_without_thunderbolt_hooks_is_a_clear_error(monkeypatch):
    train_vit = load_example("train_vit")

    def missing() -> None:
        raise ImportError("No module named 'torch_thunderbolt'")

    monkeypatch.setattr(train_vit, "import_thunderbolt", missing)
    with pytest.raises(ValueError, match="needs torch_thunderbolt.hooks"):
        train_vit.select_hook("int8")
    assert "fp16_compress_hook" in train_vit.select_hook("fp16")[2]
    assert "bf16_compress_hook" in train_vit.select_hook("bf16")[2]


def test_median():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5


@pytest.mark.parametrize("script,argv,message", [
    ("pipeline_inference", ["--batch", "2", "--microbatches", "3"], "exceeds the smallest --batch"),
    ("pipeline_inference", ["--layers", "1", "--nproc", "2"], "cannot split 1 layers over 2 stages"),
    ("pipeline_inference", ["--tokens", "0"], "--tokens and --prompt-len must be >= 1"),
    ("train_vit", ["--image-size", "40"], "multiple of patch"),
    ("train_vit", ["--steps", "0"], "--batch and --steps must be >= 1"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(script, argv, message, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    module = load_example(script)
    with pytest.raises(ValueError, match=message):
        module.parse_args(argv)
