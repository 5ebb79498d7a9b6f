"""The demo LoRA writer, and the check every adapter folder passes before an engine sees it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared.demo.lora import MARKER_FILE, RANK, write_demo_lora
from shared.lora_paths import OUTSIDE_ROOTS
from shared.peft_layout import TARGET_MODULES, LlamaShapes
from workers.engines.base import LoraLoadError
from workers.engines.lora.check import check_adapter

CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "head_dim": 64,
}


ANYWHERE = (Path("/"),)


def model_folder(path: Path, **changes: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    return path


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return model_folder(tmp_path / "base")


@pytest.fixture
def adapter(tmp_path: Path, base: Path) -> Path:
    return write_demo_lora(tmp_path / "adapter", base=base, seed=3)


def shapes() -> LlamaShapes:
    return LlamaShapes.from_config(CONFIG)


def test_demo_adapter_is_peft_and_passes_the_check(adapter: Path, base: Path) -> None:
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == (
        "LORA",
        RANK,
        list(TARGET_MODULES),
    )
    files = check_adapter(str(adapter), roots=ANYWHERE, max_rank=8, model=shapes())
    assert files.rank == RANK and files.weights.name == "adapter_model.safetensors"
    # Written again: nothing changes; another seed: replaced.
    before = (adapter / "adapter_model.safetensors").read_bytes()
    write_demo_lora(adapter, base=base, seed=3)
    assert (adapter / "adapter_model.safetensors").read_bytes() == before
    write_demo_lora(adapter, base=base, seed=4)
    assert (adapter / "adapter_model.safetensors").read_bytes() != before
    assert (adapter / MARKER_FILE).is_file()


def test_the_demo_adapter_matches_grouped_query_shapes(adapter: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as weights:
        k_b = weights.get_tensor("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight")
        down_a = weights.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
    assert tuple(k_b.shape) == (2 * 64, RANK)  # kv heads x head_dim
    assert tuple(down_a.shape) == (RANK, 512)


def test_a_folder_that_is_not_an_adapter_is_never_overwritten(tmp_path: Path, base: Path) -> None:
    other = tmp_path / "precious"
    other.mkdir()
    (other / "data.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        write_demo_lora(other, base=base)
    assert (other / "data.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("missing", "no adapter folder"),
        ("relative", "is not absolute"),
        ("no-config", "has no adapter_config.json"),
        ("bad-config", "unreadable adapter_config.json"),
        ("no-weights", "has no adapter_model"),
        ("truncated", "is corrupt"),
        ("garbage", "is corrupt"),
        ("high-rank", "over this worker's max_lora_rank 8"),
        ("lm-head", "linear layers only"),
        ("dora", "DoRA"),
    ],
)
def test_bad_adapters_are_refused_with_a_reason(
    adapter: Path, tmp_path: Path, damage: str, reason: str
) -> None:
    path = str(adapter)
    weights = adapter / "adapter_model.safetensors"
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    if damage == "missing":
        path = str(tmp_path / "nowhere")
    elif damage == "relative":
        path = "adapter"
    elif damage == "no-config":
        config_file.unlink()
    elif damage == "bad-config":
        config_file.write_text("{not json")
    elif damage == "no-weights":
        weights.unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:20])
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 64)
    elif damage in ("high-rank", "lm-head", "dora"):
        changes = {
            "high-rank": {"r": 16},
            "lm-head": {"target_modules": ["q_proj", "lm_head"]},
            "dora": {"use_dora": True},
        }[damage]
        config_file.write_text(json.dumps({**config, **changes}))
    with pytest.raises(LoraLoadError, match=reason):
        check_adapter(path, roots=ANYWHERE, max_rank=8, model=shapes())


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"hidden_size": 512, "head_dim": 128}, "has shape .*512.*, this model's .* size is 256"),
        ({"intermediate_size": 1024}, "has shape .*1024.*, this model's .* size is 512"),
        ({"num_hidden_layers": 4}, "names layer 2, this model has 2 layers"),
    ],
)
def test_an_adapter_for_another_base_is_refused(
    tmp_path: Path, changes: dict[str, int], reason: str
) -> None:
    other = write_demo_lora(tmp_path / "other", base=model_folder(tmp_path / "m", **changes))
    with pytest.raises(LoraLoadError, match=f"made for another model.*{reason}"):
        check_adapter(str(other), roots=ANYWHERE, max_rank=8, model=shapes())
    check_adapter(
        str(other), roots=ANYWHERE, max_rank=8, model=None
    )  # unknown architecture: left to the engine


def test_a_pickled_bin_adapter_is_refused(adapter: Path, tmp_path: Path) -> None:
    copy = tmp_path / "bin"
    shutil.copytree(adapter, copy)
    (copy / "adapter_model.safetensors").rename(copy / "adapter_model.bin")
    with pytest.raises(LoraLoadError, match="only safetensors weights are loaded"):
        check_adapter(str(copy), roots=ANYWHERE, max_rank=8, model=shapes())


def test_only_folders_inside_the_roots_are_read(adapter: Path, tmp_path: Path) -> None:
    roots = (tmp_path / "roots",)
    roots[0].mkdir()
    inside = roots[0] / "linked"
    inside.symlink_to(adapter)  # a link inside a root that leads out of it
    for path in (str(adapter), str(inside), str(tmp_path / "nowhere"), "/etc"):
        with pytest.raises(LoraLoadError) as caught:
            check_adapter(path, roots=roots, max_rank=8, model=shapes())
        assert str(caught.value) == OUTSIDE_ROOTS  # the same whether or not it exists
    (roots[0] / "real").symlink_to(roots[0])  # a link that stays inside is fine
    shutil.copytree(adapter, roots[0] / "a")
    files = check_adapter(str(roots[0] / "real" / "a"), roots=roots, max_rank=8, model=None)
    assert files.path == (roots[0] / "a").resolve()


def test_the_cli_writes_a_demo_adapter(tmp_path: Path, base: Path) -> None:
    from conveyor.cli import main

    target = tmp_path / "cli-adapter"
    assert main(["demo-model", str(target), "--kind", "lora", "--base", str(base)]) == 0
    assert check_adapter(str(target), roots=ANYWHERE, max_rank=8, model=shapes()).rank == RANK
    assert (
        main(
            [
                "demo-model",
                str(tmp_path / "x"),
                "--kind",
                "lora",
                "--base",
                str(tmp_path / "no-model"),
            ]
        )
        == 2
    )
