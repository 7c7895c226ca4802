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


def test_index_inputs_are_found_through_views_that_keep_their_values() -> None:
    """``view.dtype`` reinterprets the bytes: its values are not the input's, so they are not checked."""
    import torch

    from hatch_aoti.worker.entry import index_rows

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words, self.places = torch.nn.Embedding(50, 4), torch.nn.Embedding(7, 4)
            self.table = torch.nn.Parameter(torch.randn(9, 4))

        def forward(self, ids, places, picked, raw, table):  # type: ignore[no-untyped-def]
            found = self.words(ids.view(-1)).sum() + self.places(places).sum() + self.words(places).sum()
            found = found + self.table.index_select(0, picked).sum() + self.words(raw.view(torch.int32)).sum()
            return found + table.index_select(1, picked).sum()

    long = [torch.zeros(3, dtype=torch.int64) for _ in range(3)]
    inputs = (long[0].view(1, 3), long[1], torch.zeros(2, dtype=torch.int32), long[2], torch.randn(3, 9))
    exported = torch.export.export(Model(), inputs)
    assert index_rows(exported) == {"ids": 50, "places": 7, "picked": 9}


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
