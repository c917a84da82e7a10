"""The shared report writer of the benchmarks."""
from bench.report import write_report


def test_write_report_prints_and_writes_one_markdown_text(tmp_path, capsys):
    text = write_report(str(tmp_path / "new"), "r.md", ["# title", "", "| a |"])
    assert text == "# title\n\n| a |\n" and (tmp_path / "new" / "r.md").read_text() == text
    assert "| a |" in capsys.readouterr().out
