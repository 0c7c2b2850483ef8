"""Fuzzing the fleet's outside inputs (issue 38) with seeded generators: the `engines` config section through
`edge-agent check-config`, build-claim topics and retained rollouts on a real broker, `fleet deploy`'s
options, oci:// artifact URLs and a registry answering junk. Each case must end as the contract says (one
line naming the file and key, exit 2; CacheUnavailable / CacheRejected; no crash), never with a traceback or
a secret. Deterministic (fixed seeds) and bounded in count."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import pytest

from agent.cli.main import main
from agent.deploy.signing import generate_keys
from engines.cache.ref import parse_cache_url

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "agent" / "assets" / "nanodet-m-416.onnx"
LABELS = REPO / "agent" / "assets" / "coco.names"
MARK = "SECRETMARK9"
BASE = (
    f"models:\n  det: {{onnx: {MODEL}, format: nanodet, backend: onnxruntime, labels: {LABELS}}}\n"
    "cameras: {}\nmqtt: {enabled: false}\n"
)


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse
            code = int(stop.code or 0)
    return code, out.getvalue(), err.getvalue()


def check_config(tmp_path: Path, engines: dict[str, str]) -> tuple[int, str]:
    path = tmp_path / "agent.yaml"
    path.write_text(BASE + "engines:\n" + "".join(f"  {k}: {v}\n" for k, v in engines.items()))
    code, out, err = cli(["check-config", "-c", str(path)])
    assert "internal error" not in err and "Traceback" not in err, err
    return code, out + err


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keys(tmp_path / "keys", "dev1")


def valid_section(keys: tuple[Path, Path]) -> dict[str, str]:
    private, public = keys
    return {
        "cache": '"oci://127.0.0.1:5000/site/engines"',
        "signing_key": json.dumps(str(private)),
        "signing_key_id": "dev1",
        "trusted_keys": json.dumps({"dev1": str(public)}),
    }


@pytest.mark.parametrize("url", ["oci://h\n/x", "oci://h/x\n", "oci://h:5000/x\t", "oci://h:٥٠٠٠/x", "oci://h:５０００/x"])
def test_a_cache_url_with_a_control_character_or_non_ascii_port_is_refused(url: str) -> None:
    # Before: urlsplit dropped the newline and int() read the Arabic-Indic digits: the config kept (and
    # logged) a URL that was never the one checked.
    with pytest.raises(ValueError):
        parse_cache_url(url)


def test_the_engines_cache_url_fuzzed_through_check_config(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    rng = random.Random(38)
    parts = ["oci://", "127.0.0.1", ":5000", "[::1]", "/site", "/engines", "?plain-http=true", "@", MARK, ":",
             "\n", " ", "é", "٥", "#", "%00", "//", "..", "A", "?", "&", "=", "http://", "x" * 300]
    for _ in range(60):
        url = "".join(rng.choice(parts) for _ in range(rng.randint(1, 8)))
        code, text = check_config(tmp_path, {**valid_section(keys), "cache": json.dumps(url)})
        assert code in (0, 2), text
        assert MARK not in text, text
        if code == 2:
            assert text.count("\n") == 1 and "engines.cache: " in text, text
