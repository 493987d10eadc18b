"""Checkpoint integrity, in process: the sha256 manifest catches corrupt or missing files, and
no checkpoint file (``common.pt``, ``.metadata``, a byte item inside a ``.distcp``) or plan file
that would run code when unpickled gets unpickled. Each crafted file's payload would create a
marker directory; the marker must not appear (and does appear when torch's own distributed
checkpoint reader is given the same file, so the check is what protects the run)."""

import contextlib
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ext.precision.plan import load_plan
from megatron_ext.training.checkpoint_integrity import (MANIFEST, check_no_code, verify_checkpoint,
                                                        verify_manifest, write_manifest)
from megatron_ext.errors import UsageError


class RunsCode:
    """Unpickling this calls ``os.mkdir(marker)``: a stand-in for any code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _save(ckpt, state: dict, common) -> None:
    """A torch distributed checkpoint of ``state`` plus a common.pt, as dist_checkpointing
    writes them (non-tensor values become byte items inside the .distcp file)."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt)), no_dist=True)
    torch.save(common, ckpt / "common.pt")
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "iter_0000003"
    _save(path, {"w": torch.arange(6.0).reshape(2, 3), "rng": {"cpu": torch.arange(4)}},
          {"iteration": 3, "layout": {"tp": 1}})
    write_manifest(str(path))
    return path


def _rewrite_manifest(ckpt) -> None:
    """What the maker of a crafted checkpoint does: checksums that match the crafted files."""
    os.remove(ckpt / MANIFEST)
    write_manifest(str(ckpt))


def test_good_checkpoint_passes(ckpt):
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "common.pt",
                                         "metadata.json"]
    verify_checkpoint(str(ckpt))


def test_flipped_byte_names_the_file(ckpt):
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError, match=r"checkpoint file '.*__0_0\.distcp' is corrupt"):
        verify_manifest(str(ckpt))


def test_missing_file_is_named(ckpt):
    os.remove(ckpt / "common.pt")
    with pytest.raises(UsageError, match=r"'.*common\.pt' \(listed in checksums.json\) is missing"):
        verify_manifest(str(ckpt))


def test_corrupt_manifest(ckpt):
    (ckpt / MANIFEST).write_text("{not json")
    with pytest.raises(UsageError, match="checksums.json' is corrupt"):
        verify_manifest(str(ckpt))


def test_checkpoint_without_manifest_loads_only_unverified(ckpt, capsys, tmp_path):
    os.remove(ckpt / MANIFEST)
    assert verify_manifest(str(ckpt)) is False
    with pytest.raises(UsageError, match="has no checksums.json.*pass --load-unverified"):
        verify_checkpoint(str(ckpt))
    verify_checkpoint(str(ckpt), unverified=True)
    assert "unverified (--load-unverified): it has no checksums.json" in capsys.readouterr().out
    marker = tmp_path / "marker"  # and unverified is still checked for code
    torch.save({"iteration": 3, "payload": RunsCode(marker)}, ckpt / "common.pt")
    with pytest.raises(UsageError, match="refusing"):
        verify_checkpoint(str(ckpt), unverified=True)
    assert not marker.exists()


def test_common_pt_that_runs_code_is_refused(ckpt, tmp_path):
    marker = tmp_path / "marker"
    torch.save({"iteration": 3, "payload": RunsCode(marker)}, ckpt / "common.pt")
    _rewrite_manifest(ckpt)
    with pytest.raises(UsageError, match=r"refusing '.*common\.pt': it names posix\.mkdir"):
        verify_checkpoint(str(ckpt))
    assert not marker.exists()


def test_metadata_that_runs_code_is_refused(ckpt, tmp_path):
    marker = tmp_path / "marker"
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    _rewrite_manifest(ckpt)
    with pytest.raises(UsageError, match=r"refusing '.*\.metadata': it names posix\.mkdir"):
        verify_checkpoint(str(ckpt))
    assert not marker.exists()
    with contextlib.suppress(Exception):  # torch's own reader: plain pickle.load
        dcp.FileSystemReader(str(ckpt)).read_metadata()
    assert marker.exists()


def test_byte_item_that_runs_code_is_refused(tmp_path):
    ckpt, marker = tmp_path / "iter_0000001", tmp_path / "marker"
    _save(ckpt, {"w": torch.zeros(2), "rng": RunsCode(marker)}, {"iteration": 1})
    write_manifest(str(ckpt))
    with pytest.raises(UsageError, match=r"refusing '.*__0_0\.distcp:rng': it names posix\.mkdir"):
        check_no_code(str(ckpt))
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "rng": None}, storage_reader=dcp.FileSystemReader(str(ckpt)),
             no_dist=True)  # torch's planner: torch.load(weights_only=False)
    assert marker.exists()


def test_truncated_metadata_is_unreadable_not_unsafe(ckpt):
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:40])
    with pytest.raises(UsageError, match=r"cannot read checkpoint file '.*\.metadata'"):
        check_no_code(str(ckpt))


def test_plan_file_that_runs_code_is_refused(tmp_path):
    marker, plan = tmp_path / "marker", tmp_path / "plan.json"
    plan.write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ValueError, match=r"plan\.json' is not a JSON text file"):
        load_plan(str(plan))  # plans are JSON only
    assert not marker.exists()


def test_no_plain_unpickling_in_the_code_base():
    """Every reader of files here uses JSON, safetensors, weights-only torch.load or the
    restricted unpickler: no bare pickle.load / torch.load(weights_only=False)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    offenders = []
    for top in ("megatron_ext", "tools"):
        for folder, _, names in os.walk(os.path.join(root, top)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                for needle in ("pickle.load(", "pickle.loads(", "weights_only=False",
                               "allow_pickle=True"):
                    if needle in text:
                        offenders.append(f"{name}: {needle}")
                for call in text.split("torch.load(")[1:]:
                    if "weights_only=True" not in call.split(")")[0]:
                        offenders.append(f"{name}: torch.load without weights_only=True")
    assert offenders == []
