"""Weight export for sync: merged/adapter tensors, buckets and their checksum on a tiny real Qwen2-VL."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForImageTextToText

from rollmatch.errors import SyncError
from rollmatch.models.tiny import build_tiny_model
from rollmatch.sync.digest import bucket_checksum
from rollmatch.sync.weights import (
    flatten_buckets,
    iter_sync_tensors,
    peft_adapter_config,
    unflatten_bucket,
)

Q_PROJ = "model.language_model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("tiny") / "qwen2_vl"))


def _load(model_dir: str) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _lora(model_dir: str, *, use_dora: bool = False) -> torch.nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=use_dora)
    peft_model = get_peft_model(_load(model_dir), config)
    torch.manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name or "lora_magnitude" in name:  # lora_B starts at 0: make the adapter matter
            param.data.normal_(0.0, 0.5 if "lora_B" in name else 1.0).abs_()
    return peft_model


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_full_export_of_a_plain_model_is_its_state_dict(model_dir: str) -> None:
    model = _load(model_dir)
    exported = dict(iter_sync_tensors(torch.nn.DataParallel(model), "full"))
    state = model.state_dict()
    assert list(exported) == list(state)
    assert any(k.startswith("model.visual.") for k in exported) and "lm_head.weight" in exported
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name


def test_full_export_merges_lora_exactly_and_leaves_the_model_unchanged(model_dir: str) -> None:
    model = _lora(model_dir)
    before = _snapshot(model)
    exported = dict(iter_sync_tensors(model, "full"))

    assert list(exported) == list(_load(model_dir).state_dict())
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model.") for k in exported)
    layer = model.base_model.model.model.language_model.layers[0].self_attn.q_proj
    manual = layer.base_layer.weight + (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * 2.0
    assert torch.allclose(exported[Q_PROJ], manual, atol=1e-6)
    assert not torch.allclose(exported[Q_PROJ], layer.base_layer.weight)  # the adapter really changed it
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, tensor in exported.items():
        assert torch.allclose(tensor, reference[name], atol=1e-6), name
    after = _snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-exact, not merge/unmerge drift
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged_adapters"))


def test_full_export_merges_dora_like_peft(model_dir: str) -> None:
    model = _lora(model_dir, use_dora=True)
    before = _snapshot(model)
    exported = dict(iter_sync_tensors(model, "full"))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(exported) == set(reference)
    for name, tensor in exported.items():
        assert torch.allclose(tensor, reference[name], atol=1e-5), name
    assert all(torch.equal(before[k], v) for k, v in _snapshot(model).items())


def test_model_is_unchanged_when_the_consumer_raises(model_dir: str) -> None:
    model = _lora(model_dir)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="consumer failed"):
        for name, _ in iter_sync_tensors(model, "full"):
            if name == Q_PROJ:
                raise RuntimeError("consumer failed")
    assert all(torch.equal(before[k], v) for k, v in _snapshot(model).items())


def test_tied_lm_head_is_not_sent(model_dir: str) -> None:
    model = _load(model_dir)
    model.lm_head.weight = model.model.language_model.embed_tokens.weight
    names = [name for name, _ in iter_sync_tensors(model, "full")]
    assert "lm_head.weight" not in names and "model.language_model.embed_tokens.weight" in names


def test_adapter_export_uses_peft_checkpoint_names(model_dir: str) -> None:
    model = _lora(model_dir)
    exported = dict(iter_sync_tensors(model, "adapter"))
    assert len(exported) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert all(k.startswith("base_model.model.model.language_model.") for k in exported)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in exported)
    name = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight"
    layer = model.base_model.model.model.language_model.layers[0].self_attn.q_proj
    assert torch.equal(exported[name], layer.lora_B["default"].weight)
    config = peft_adapter_config(model)
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == ["q_proj", "v_proj"]


def test_adapter_export_rejects_plain_and_dora_models(model_dir: str) -> None:
    with pytest.raises(SyncError, match=r"sync\.mode: full"):
        list(iter_sync_tensors(_load(model_dir), "adapter"))
    with pytest.raises(SyncError, match="DoRA"):
        list(iter_sync_tensors(_lora(model_dir, use_dora=True), "adapter"))


def test_sharded_parameters_export_only_whole(model_dir: str) -> None:
    from rollmatch.sync.weights import SyncTensors, Zero3Gather

    model = _load(model_dir)
    for param in model.parameters():
        param.ds_id = 0  # what DeepSpeed ZeRO-3 sets on every parameter
    with pytest.raises(SyncError, match="DeepSpeed does not import"):
        list(iter_sync_tensors(model, "full"))
    with pytest.raises(SyncError, match="full sync, no LoRA"):
        SyncTensors(model, "adapter", gather=Zero3Gather(gathered_parameters=lambda *a, **k: None))


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),  # odd byte count: next tensor must still be aligned
        ("c", torch.tensor(3.5)),  # 0-dim
        ("d", torch.arange(11, dtype=torch.int64)),
        ("e", torch.randn(64, 64)),  # 16 KiB: bigger than the bucket below
        ("f", torch.randn(2, 3).to(torch.float16)),
        ("g", torch.zeros(0, 4)),
    ]


def test_buckets_round_trip_exactly_and_respect_the_size() -> None:
    tensors = _mixed_tensors()
    buckets = list(flatten_buckets(iter(tensors), bucket_bytes=256))
    assert len(buckets) >= 3
    assert any(len(b.metas) == 1 and b.metas[0].name == "e" for b in buckets)  # oversized: alone
    assert all(b.num_bytes <= 256 for b in buckets if len(b.metas) > 1)
    restored = [pair for b in buckets for pair in unflatten_bucket(b.metas, b.flat)]
    assert [n for n, _ in restored] == [n for n, _ in tensors]
    for (_, got), (_, want) in zip(restored, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    tensors[0][1].add_(1.0)  # buckets hold copies
    assert not torch.equal(restored[0][1], tensors[0][1])


def test_unflatten_rejects_a_layout_mismatch() -> None:
    bucket = next(flatten_buckets([("a", torch.randn(8))]))
    with pytest.raises(SyncError, match="'a'"):
        unflatten_bucket(bucket.metas, bucket.flat[:16])


def test_bucket_checksum_sees_layout_and_bytes() -> None:
    """The one checksum of a sync (``sync.digest.bucket_checksum``) on flattened real buckets."""
    tensors = _mixed_tensors()

    def digest(named: list[tuple[str, torch.Tensor]]) -> str:
        (bucket,) = flatten_buckets(named, bucket_bytes=1 << 20)
        return bucket_checksum(bytes(32), bucket.metas, bucket.flat)

    reference = digest(tensors)
    assert digest([(n, t.clone()) for n, t in tensors]) == reference
    assert digest(list(reversed(tensors))) != reference  # layout: order
    flipped = [(n, t.clone()) for n, t in tensors]
    flipped[4][1].view(torch.int32)[5, 7] ^= 1  # one bit
    assert digest(flipped) != reference
    renamed = [("x" if n == "a" else n, t) for n, t in tensors]
    assert digest(renamed) != reference  # layout: names
