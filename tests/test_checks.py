"""Checks that need torch but no compiling: Inductor settings, tagging failures."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from hatch_aoti.pipeline.core import BuildFailed, _tag
from hatch_aoti.worker.checks import inductor_settings

P = "tool.x.models.m.inductor-configs"


def test_nested_tables_are_read_as_dotted_names() -> None:
    problems: list[tuple[str, str]] = []
    written = {"aot_inductor": {"enable_line_tables": True}, "cpp.simdlen": 256, "max_autotune": False}
    assert inductor_settings(written, P, problems) == {
        "aot_inductor.enable_line_tables": True,
        "cpp.simdlen": 256,
        "max_autotune": False,
    }
    assert problems == []


def test_settings_that_take_a_table_keep_it() -> None:
    problems: list[tuple[str, str]] = []
    assert inductor_settings({"post_grad_fusion_options": {}}, P, problems) == {"post_grad_fusion_options": {}}
    assert problems == []


def test_unknown_settings_are_refused_with_a_suggestion() -> None:
    problems: list[tuple[str, str]] = []
    assert inductor_settings({"max_autotun": True, "aot_inductor": {"enable_line_table": True}}, P, problems) is None
    found = dict(problems)
    assert "did you mean `max_autotune`?" in found[f"{P}.max_autotun"]
    assert "is not an Inductor setting of torch 2." in found[f"{P}.aot_inductor.enable_line_table"]
    assert "did you mean `aot_inductor.enable_line_tables`?" in found[f"{P}.aot_inductor.enable_line_table"]


def test_settings_set_twice_or_of_another_type_are_refused() -> None:
    """Inductor checks neither: the last of two wins, and a string ``"false"`` counts as true."""
    problems: list[tuple[str, str]] = []
    twice = {"aot_inductor.enable_line_tables": True, "aot_inductor": {"enable_line_tables": False}}
    assert inductor_settings(twice, P, problems) is None
    assert dict(problems) == {f"{P}.aot_inductor.enable_line_tables": "is set twice, as a dotted name and in its table"}
    problems.clear()
    wrong = {"freezing": "yes", "aot_inductor.enable_line_tables": "false", "cpp.threads": 1.5, "max_autotune": 1}
    assert inductor_settings(wrong, P, problems) is None
    found = dict(problems)
    assert found[f"{P}.freezing"] == "must be true or false, as torch's default (False) is; not 'yes'"
    assert found[f"{P}.aot_inductor.enable_line_tables"].startswith("must be true or false")
    assert found[f"{P}.cpp.threads"].startswith("must be an integer") and f"{P}.max_autotune" in found
    problems.clear()
    fine = {"cpp.simdlen": 256, "max_autotune_gemm_backends": "CPP,ATEN", "cpp.threads": 2, "freezing": True}
    assert inductor_settings(fine, P, problems) == fine and problems == []


def test_libraries_that_cannot_be_tagged_fail_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hatch_aoti.pipeline import tagging as platform_tag

    library = tmp_path / "_aoti" / "m" / "model.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF" + b"\x00" * 12)  # an ELF header cut short
    with pytest.raises(BuildFailed, match="cannot tag the wheel from its compiled libraries"):
        _tag(tmp_path)

    def unknown_machine(*args: object) -> None:
        raise platform_tag.TagError("model.so: unsupported ELF machine EM_RISCV")

    monkeypatch.setattr(platform_tag, "platform_tag", unknown_machine)
    with pytest.raises(BuildFailed, match="unsupported ELF machine EM_RISCV"):
        _tag(tmp_path)
