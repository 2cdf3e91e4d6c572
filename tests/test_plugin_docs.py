"""The plugin author's guide (docs/plugins.md) stays in sync with the hook specs, and
`dlrover plugins hooks` prints the reference it embeds."""

from __future__ import annotations

import re

from click.testing import CliRunner
from helpers import ROOT

from dlrover_core import hookspecs
from dlrover_core.cli import main as cli
from dlrover_core.plugin_docs import BEGIN_MARKER, END_MARKER, embedded_reference, hook_reference, hook_specs

DOCS = ROOT / "docs" / "plugins.md"
SPEC_NAMES = sorted(n for n in vars(hookspecs) if n.startswith("dlrover_") and callable(getattr(hookspecs, n)))


def test_docs_embed_exactly_the_generated_hook_reference():
    embedded = embedded_reference(DOCS.read_text())
    assert embedded is not None, f"docs/plugins.md lacks {BEGIN_MARKER!r} ... {END_MARKER!r}"
    assert embedded == hook_reference(), "docs are stale: run `dlrover plugins hooks --update docs/plugins.md`"


def test_reference_documents_every_hook_spec_in_file_order():
    reference = hook_reference()
    documented = re.findall(r"^#### `(dlrover_\w+)\(", reference, re.MULTILINE)
    assert sorted(documented) == SPEC_NAMES and len(SPEC_NAMES) == 6
    assert [fn.__name__ for _, fns in hook_specs() for fn in fns] == documented
    assert "#### `dlrover_register_storages(register)`" in reference
    assert "### Lifecycle observers" in reference  # the banners of hookspecs.py become sections
    assert ":class:" not in reference and "``" not in reference  # reST turned into Markdown


def test_cli_prints_the_reference_and_updates_a_file(tmp_path):
    runner = CliRunner()
    out = runner.invoke(cli, ["plugins", "hooks"])
    assert out.exit_code == 0 and out.output == hook_reference()
    page = tmp_path / "page.md"
    page.write_text(f"# intro\n\n{BEGIN_MARKER}\nstale\n{END_MARKER}\n\n# after\n")
    out = runner.invoke(cli, ["plugins", "hooks", "--update", str(page)])
    assert out.exit_code == 0 and "updated" in out.output
    text = page.read_text()
    assert text.startswith("# intro\n") and text.endswith(f"{END_MARKER}\n\n# after\n")
    assert embedded_reference(text) == hook_reference()
    assert "already up to date" in runner.invoke(cli, ["plugins", "hooks", "--update", str(page)]).output
    (tmp_path / "bare.md").write_text("no markers\n")
    out = runner.invoke(cli, ["plugins", "hooks", "--update", str(tmp_path / "bare.md")])
    assert out.exit_code == 1 and "needs the lines" in out.output


def test_guide_covers_every_kind_and_the_loading_rules():
    text = DOCS.read_text()
    guide = text[: text.index(BEGIN_MARKER)]
    for hook in SPEC_NAMES:
        assert f"def {hook}(" in guide, f"no example implementing {hook}"
    for needle in ("[project.entry-points.dlrover]", "dlrover-plugin-NAME", "dlrover_plugin_NAME", "DLROVER_PLUGINS",
                   "DLROVER_DISABLE_PLUGINS", "capabilities", "dlrover plugins list", "import failed:",
                   "registered by more than one plugin", "dlrover_host", "make_job", "log_events",
                   "register_plugin", "StorageContract", "InMemoryStorage", "RecordingScheduler"):
        assert needle in guide, needle


def test_guide_python_examples_compile():
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        compile(block, f"docs/plugins.md python block {i}", "exec")
