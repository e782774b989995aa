"""scripts/bench_s3.py (make bench, section 7): its baseline (scripts/s3_upload.py) uploads every
file byte for byte, as multipart uploads with the part size asked for, and its targets table says
met / not met."""

from __future__ import annotations

import os

from scripts.bench_s3_report import targets
from scripts.s3_upload import upload_folder


def test_the_baseline_upload_puts_every_file_byte_for_byte_in_parts(s3server, s3bucket, tmp_path, monkeypatch):
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RESHARD_S3_PART_SIZE", str(5 << 20))
    files = {"a.safetensors": os.urandom(12 << 20), "config.json": b"{}", "empty.txt": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    upload_folder(tmp_path, f"s3://{s3bucket}/up/")
    s3 = s3server.client()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=s3bucket)["Contents"]}
    assert keys == {f"up/{n}" for n in files}
    for name, data in files.items():
        assert s3.get_object(Bucket=s3bucket, Key=f"up/{name}")["Body"].read() == data
    parts = s3.head_object(Bucket=s3bucket, Key="up/a.safetensors", PartNumber=1)
    assert parts["PartsCount"] == 3  # 12 MiB in 5 MiB parts


def test_the_targets_say_met_or_not():
    run = {"seconds": 10.0, "rss": 0}
    hub = {
        "bytes": 10**9,
        "ratio": 0.6,
        "runs": {"--stream to s3://": [{"disk_peak": 4 << 20}], "hf download + save + upload": []},
    }
    rss = [
        {"checkpoint": {"bytes": 2 * 10**9}, "rss": 800 << 20},
        {"checkpoint": {"bytes": 16 * 10**9}, "rss": 900 << 20},
    ]
    r = {"upload": {"ratio": 1.05, "runs": {"save": [run]}}, "hub": hub, "rss": rss}
    assert targets(r)[2:] == [
        "| save to s3:// / upload of the saved folder <= 1.1 | 1.05 | yes |",
        "| Hub -> S3 --stream / (hf download + save + upload) <= 0.5 | 0.60 | no |",
        "| Hub -> S3 --stream local disk < 1% of the checkpoint (10 MiB) | 4 MiB | yes |",
        "| save to s3:// peak RSS flat and <= 1 GiB | 2 GB: 800 MiB / 16 GB: 900 MiB | yes |",
    ]
    rss[1]["rss"] = 1100 << 20
    assert targets(r)[-1] == "| save to s3:// peak RSS flat and <= 1 GiB | 2 GB: 800 MiB / 16 GB: 1.07 GiB | no |"
