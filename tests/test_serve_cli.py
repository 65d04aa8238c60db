"""serve.py's command-line checks (the server itself is covered by test_server.py)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import serve  # noqa: E402


def test_missing_target_dir_is_named():
    with pytest.raises(SystemExit, match="target model directory /nonexistent/target not found"):
        serve.main(["--target", "/nonexistent/target"])


def test_missing_drafter_dir_is_named():
    target = str(pathlib.Path(serve.__file__).parent / "assets" / "target")
    with pytest.raises(SystemExit, match="drafter directory /nonexistent/drafter not found"):
        serve.main(["--target", target, "--drafter", "/nonexistent/drafter"])


def test_demo_prompts_fall_back_without_shared(capsys):
    prompts = serve.humaneval_prompts("/nonexistent/humaneval.jsonl", 3)
    assert prompts == serve.FALLBACK_PROMPTS[:3]
    assert "using built-in code prompts" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--slots", "--max-queue", "--prefill-batch"])
def test_non_positive_sizes_are_named(flag, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args([flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
