"""The Python snippets of docs/HF.md that say they run on a CPU as written are run here as written
(issue 53): each ```python block whose preceding paragraph ends with "(this runs on a CPU as
written):". A snippet that stops running, or a doc that stops saying so, fails this test."""

import os
import re

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
MARK = "(this runs on a CPU as written):"


def runnable_snippets():
    text = open(os.path.join(ROOT, "docs", "HF.md"), encoding="utf-8").read()
    return [m.group(1) for m in re.finditer(re.escape(MARK) + r"\s*\n\s*```python\n(.*?)```", text, re.S)]


def test_hf_md_marks_runnable_snippets():
    assert len(runnable_snippets()) >= 1, f"docs/HF.md has no snippet marked {MARK!r}"


@pytest.mark.parametrize("i", range(len(runnable_snippets())))
def test_hf_md_snippet_runs_as_written(i):
    pytest.importorskip("transformers", minversion="5.0")
    code = runnable_snippets()[i]
    for module in re.findall(r"^\s*(?:from|import)\s+([A-Za-z_][\w]*)", code, re.M):
        pytest.importorskip(module)  # (peft is optional in the test requirements)
    namespace = {"__name__": f"hf_md_snippet_{i}"}
    exec(compile(code, f"docs/HF.md snippet {i}", "exec"), namespace)
