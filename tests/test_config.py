"""Config validation without compiling anything."""

from __future__ import annotations

import pytest

from hatch_aoti.settings.constants import HATCH_TABLE
from hatch_aoti.settings.model import DimSpec, TensorSpec
from hatch_aoti.settings.reader import ConfigError
from hatch_aoti.settings.resolve import parse_settings
from hatch_aoti.settings.spec import ModelSpec

M = f"{HATCH_TABLE}.models"


def problems(raw: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_settings(raw)
    return dict(info.value.problems)


def test_minimal_model_parses_with_defaults() -> None:
    settings = parse_settings(
        {"models": {"mlp": {"factory": "pkg.models:build", "inputs": [{"shape": [4, 128], "dtype": "float32"}]}}}
    )
    (model,) = settings.models
    assert model.name == "mlp"
    assert model.inputs == (TensorSpec((4, 128), "float32"),)
    assert model.device == "cpu" and model.verify is True and model.rtol is None
    assert settings.loader == "compiled" and settings.package is None and settings.torch_requirement is None


def test_reserved_hatch_keys_are_left_to_hatchling() -> None:
    from hatch_aoti.frontends.hatch import hook_settings

    table = {
        "dependencies": ["x"],
        "enable-by-default": True,
        "require-runtime-dependencies": False,
        "require-runtime-features": [],
        "models": {"m": {"factory": "a:b", "inputs": []}},
    }
    assert [m.name for m in hook_settings(table).models] == ["m"]
    assert "unknown key" in problems(table)[f"{HATCH_TABLE}.dependencies"], "other tables have no such keys"


def test_every_problem_is_reported_at_once_with_its_path() -> None:
    found = problems(
        {
            "packag": "x",
            "models": {
                "mlp": {"factroy": "pkg:build", "inputs": [{"shape": [4, "b"], "dtype": "flaot32"}]},
                "other": {"factory": "not an entry point", "inputs": [{"shape": [-1]}], "rtol": -1},
            },
        }
    )
    assert found[f"{HATCH_TABLE}.packag"].startswith("unknown key (did you mean `package`?)")
    assert "did you mean `factory`" in found[f"{M}.mlp.factroy"]
    assert "is required" in found[f"{M}.mlp.factory"]
    assert "did you mean `float32`" in found[f"{M}.mlp.inputs[0].dtype"]
    assert "module:attr" in found[f"{M}.other.factory"]
    assert "size >= 0" in found[f"{M}.other.inputs[0].shape[0]"]
    assert f"{M}.other.rtol" in found
    assert len(found) == 7


def test_error_message_lists_each_path() -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"models": {"m": {"factory": "a:b", "inputs": [{"shape": [1], "dtype": "nope"}]}}})
    text = str(info.value)
    assert text.startswith("hatch-aoti found 1 problem in pyproject.toml:")
    assert f"{M}.m.inputs[0].dtype: unknown dtype 'nope'" in text


@pytest.mark.parametrize(
    ("model", "path", "fragment"),
    [
        ({"factory": "a:b"}, "m", "needs example inputs"),
        ({"factory": "a:b", "inputs": [], "example-inputs": "a:c"}, "m", "not both"),
        ({"factory": "a:b", "inputs": "x"}, "m.inputs", "must be an array"),
        ({"factory": "a:b", "inputs": [3]}, "m.inputs[0]", "must be a table"),
        ({"factory": "a:b", "inputs": [{"dtype": "float32"}]}, "m.inputs[0].shape", "is required"),
        ({"factory": "a:b", "inputs": [{"shape": [2], "device": "tpu"}]}, "m.inputs[0].device", "cuda"),
        ({"factory": "a:b", "inputs": [{"shape": [2], "low": 5, "high": 1}]}, "m.inputs[0]", "below `high`"),
        ({"factory": "a:b", "inputs": [], "device": "gpu"}, "m.device", "cuda"),
        ({"factory": "a:b", "inputs": [], "verify": "yes"}, "m.verify", "true or false"),
        ({"factory": "a:b", "inputs": [], "inductor-configs": 3}, "m.inductor-configs", "table"),
        ({"factory": 3, "inputs": []}, "m.factory", "module:attr"),
        (
            {"factory": "a:b", "inputs": [{"shape": ["n"]}], "dynamic": {"n": {"min": 9, "max": 2}}},
            "m.dynamic.n",
            "min (9) is greater than max (2)",
        ),
        (
            {"factory": "a:b", "inputs": [{"shape": ["n"]}], "dynamic": {"batch": {"max": 2}}},
            "m.dynamic.batch",
            "not used by any input shape",
        ),
        (
            {"factory": "a:b", "inputs": [{"shape": ["n"]}], "dynamic": {"n": {"mx": 2}}},
            "m.dynamic.n.mx",
            "did you mean `max`",
        ),
        (
            {"factory": "a:b", "inputs": [{"shape": ["n"]}], "dynamic": {"n": {"min": 5, "max": 5}}},
            "m.dynamic.n",
            "min (5) is equal to max (5); a size that cannot vary is not dynamic",
        ),
        (
            {"factory": "a:b", "inputs": [{"shape": ["n"]}], "dynamic": {"n": {"max": 2**70}}},
            "m.dynamic.n.max",
            "2**62",
        ),
        # integers are drawn from [low, high), 0 and 100 by default, and must fit the dtype
        (
            {"factory": "a:b", "inputs": [{"shape": [2], "dtype": "int64", "low": 200}]},
            "m.inputs[0]",
            "(200) must be below `high` (100",
        ),
        (
            {"factory": "a:b", "inputs": [{"shape": [2], "dtype": "long", "high": -5}]},
            "m.inputs[0]",
            "(0) must be below `high` (-5",
        ),
        (
            {"factory": "a:b", "inputs": [{"shape": [2], "dtype": "int64", "low": 0.2}]},
            "m.inputs[0].low",
            "whole number",
        ),
        (
            {"factory": "a:b", "inputs": [{"shape": [2], "dtype": "uint8", "low": -5, "high": 3}]},
            "m.inputs[0]",
            "[0, 255]",
        ),
        ({"factory": "a:b", "inputs": [{"shape": [2], "dtype": "int8", "high": 1000}]}, "m.inputs[0]", "[-128, 127]"),
        ({"factory": "a:b\n", "inputs": []}, "m.factory", "module:attr"),
        ({"factory": "a:b", "inputs": [], "device": "cpu\n"}, "m.device", "cuda"),
        (
            {"factory": "a:b", "inputs": [], "weights": "external", "weights-url": "https://[::1/{file}"},
            "m.weights-url",
            "is not a URL (Invalid IPv6 URL)",
        ),
    ],
)
def test_model_problems(model: dict, path: str, fragment: str) -> None:
    found = problems({"models": {"m": model}})
    assert fragment in found[f"{M}.{path}"], found


def test_hook_level_problems() -> None:
    found = problems({"loader": "not-a-module", "torch-requirement": "numpy>1", "package": "1pkg"})
    assert f"{HATCH_TABLE}.models" in found
    assert "Python module name" in found[f"{HATCH_TABLE}.loader"]
    assert "requirement on torch" in found[f"{HATCH_TABLE}.torch-requirement"]
    assert "importable package name" in found[f"{HATCH_TABLE}.package"]
    assert (
        "not a valid requirement"
        in problems({"models": {}, "torch-requirement": "torch=="})[f"{HATCH_TABLE}.torch-requirement"]
    )


def test_model_names_must_be_identifiers() -> None:
    found = problems({"models": {name: {"factory": "a:b", "inputs": []} for name in ("my-model", "class", "bert\n")}})
    assert "identifiers" in found[f"{M}.my-model"] and "not Python keywords" in found[f"{M}.class"]
    assert "identifiers" in found[f'{M}."bert\\n"'], found  # quoted as TOML quotes it


def test_integer_inputs_within_their_dtype_parse() -> None:
    spec = {"shape": [2], "dtype": "int8", "low": -128, "high": 128}
    assert parse_settings({"models": {"m": {"factory": "a:b", "inputs": [spec]}}}).models[0].inputs[0].low == -128


def test_dtype_aliases_are_canonical_and_dims_named() -> None:
    settings = parse_settings(
        {
            "models": {
                "tok": {
                    "factory": "a:b",
                    "inputs": [{"shape": ["batch", "seq"], "dtype": "long", "low": 0, "high": 1000}],
                    "kwargs": {"mask": {"shape": ["batch", "seq"], "dtype": "bool"}},
                    "dynamic": {"batch": {"min": 1, "max": 8}},
                }
            }
        }
    )
    (model,) = settings.models
    assert model.inputs[0].dtype == "int64" and model.kwargs["mask"].dtype == "bool"
    assert model.dynamic == {"batch": DimSpec(1, 8)}


def test_spec_round_trips_through_json() -> None:
    (model,) = parse_settings(
        {
            "models": {
                "m": {
                    "factory": "a:b",
                    "inputs": [{"shape": ["n", 3], "dtype": "half"}],
                    "kwargs": {"k": {"shape": [2]}},
                    "dynamic": {"n": {"min": 1}},
                    "inductor-configs": {"max_autotune": False},
                    "rtol": 0.01,
                }
            }
        }
    ).models
    import dataclasses
    import json

    assert ModelSpec.from_json(json.loads(json.dumps(dataclasses.asdict(model)))) == model


def test_low_and_high_do_not_apply_to_bool_inputs() -> None:
    found = problems({"models": {"m": {"factory": "a:b", "inputs": [{"shape": [2], "dtype": "bool", "high": 2}]}}})
    assert "do not apply to bool inputs" in found[f"{M}.m.inputs[0]"]


def test_a_target_the_build_machine_cannot_run_is_refused_before_compiling() -> None:
    from hatch_aoti.settings.cpu_targets import X86_64_V3, X86_64_V4

    table = {"cpu-target": "x86-64-v4", "models": {"m": {"factory": "a:b", "inputs": []}}}
    with pytest.raises(ConfigError) as info:
        parse_settings(table, machine="x86_64", flags=set(X86_64_V3))
    message = dict(info.value.problems)[f"{HATCH_TABLE}.cpu-target"]
    assert "lacks (avx512bw, avx512cd, avx512dq, avx512f, avx512vl)" in message
    assert parse_settings(table, machine="x86_64", flags=set(X86_64_V4)).models[0].cpu_target == "x86-64-v4"


def test_target_settings_written_as_nested_tables_still_conflict() -> None:
    found = problems({"models": {"m": {"factory": "a:b", "inputs": [], "inductor-configs": {"cpp": {"simdlen": 512}}}}})
    assert "is set by cpu-target" in found[f"{M}.m.inductor-configs.cpp.simdlen"]


def test_the_table_path_is_the_one_the_user_wrote() -> None:
    from hatch_aoti.settings.constants import SETUPTOOLS_TABLE

    with pytest.raises(ConfigError) as info:
        parse_settings({"models": {"m": {"factroy": "a:b", "inputs": []}}}, SETUPTOOLS_TABLE)
    assert [p for p, _ in info.value.problems] == [
        "tool.hatch-aoti.models.m.factroy",
        "tool.hatch-aoti.models.m.factory",
    ]


def test_torch_requirement_must_allow_the_build_torch() -> None:
    from hatch_aoti.pipeline.core import torch_requirement

    def settings(requirement: str | None):
        table = {"models": {"m": {"factory": "a:b", "inputs": []}}}
        return parse_settings({**table, **({"torch-requirement": requirement} if requirement else {})})

    assert torch_requirement(settings(None), "2.13.0+cpu") == "torch==2.13.*"
    assert torch_requirement(settings("torch>=2.13,<2.15"), "2.13.0+cpu") == "torch>=2.13,<2.15"
    with pytest.raises(ConfigError) as info:
        torch_requirement(settings("torch==2.12.*"), "2.13.0+cpu")
    ((path, message),) = info.value.problems
    assert path == f"{HATCH_TABLE}.torch-requirement"
    assert "'torch==2.12.*' does not allow the torch in the build environment (2.13.0+cpu)" in message


@pytest.mark.parametrize(
    ("requirement", "backend", "fragment"),
    [
        ("torch>=2.13", "aoti", "'torch>=2.13' allows every later torch"),
        ("torch", "aoti", "'torch' allows every later torch"),
        ("torch>=2.13,<2.15", "precompile", 'load only under torch==2.13.0: state "torch==2.13.0"'),
        ("torch==2.13.*", "precompile", "'torch==2.13.*' allows other torch releases"),
    ],
)
def test_the_torch_requirement_key_is_bounded_and_exact_for_precompiled_models(
    requirement: str, backend: str, fragment: str
) -> None:
    """As a requirement in ``[project] dependencies`` is: the key reaches the wheel where the front end adds it."""
    from hatch_aoti.pipeline.core import wheel_pins

    model = {"factory": "a:b", "inputs": [], "backend": backend}
    settings = parse_settings({"torch-requirement": requirement, "models": {"m": model}})
    with pytest.raises(ConfigError) as info:
        wheel_pins(settings, "2.13.0")
    assert fragment in dict(info.value.problems)[f"{HATCH_TABLE}.torch-requirement"]
    for pin in ("torch==2.13.0", "torch == 2.13.0", "torch==2.13.0+cpu"):  # the exact pin, however written
        exact = parse_settings({"torch-requirement": pin, "models": {"m": model}})
        assert wheel_pins(exact, "2.13.0+cpu").torch == (pin if backend == "aoti" else "torch==2.13.0"), pin


def test_the_reference_and_the_schema_are_generated_from_the_settings() -> None:
    from pathlib import Path

    from hatch_aoti.settings.docs import ENV_PAGE, PAGE, SCHEMA, environment_tables, reference_tables, schema_text

    root = Path(__file__).resolve().parent.parent
    for where, tables in ((PAGE, reference_tables()), (ENV_PAGE, environment_tables())):
        page = (root / where).read_text(encoding="utf-8")
        for marker, table in tables.items():
            start, end = f"<!-- {marker} -->\n", f"<!-- /{marker} -->"
            assert start in page, f"{where} lacks the {marker} table"
            written = page.split(start, 1)[1].split(end, 1)[0]
            stale = f"{where}'s {marker} table is stale: run `python -m hatch_aoti.settings.docs --write`"
            assert written == table, stale
    assert (root / SCHEMA).read_text(encoding="utf-8") == schema_text(), f"{SCHEMA} is stale: run the same"


def test_validate_pyproject_checks_the_table_with_the_schema() -> None:
    """Through the ``validate_pyproject.tool_schema`` entry point, as editors and pre-commit use it."""
    import tomllib
    from conftest import REPO
    from validate_pyproject import api

    validator = api.Validator()
    document = tomllib.loads((REPO / "sample_project_setuptools" / "pyproject.toml").read_text(encoding="utf-8"))
    validator(document)
    for misspelt, where in (
        ({"torch-requirment": "x"}, "`tool.hatch-aoti`"),
        ({"models": {"m": {"factory": "a:b", "inptus": []}}}, "`tool.hatch-aoti.models.m`"),
        ({"models": {"m": {"factory": "a:b", "dynamic": {"n": {"min": "1"}}}}}, "min"),
        ({"models": {"bad-name": {"factory": "a:b"}}}, "`tool.hatch-aoti.models` keys must be named"),
        ({"models": {"class": {"factory": "a:b"}}}, "`tool.hatch-aoti.models` keys must be named"),
    ):
        with pytest.raises(Exception, match=where) as info:
            validator({**document, "tool": {"hatch-aoti": misspelt}})
        assert type(info.value).__name__ in ("ValidationError", "JsonSchemaValueException"), info.value


def test_what_json_schema_cannot_refuse_the_reader_refuses() -> None:
    """JSON Schema counts 2.0 as an integer and has no NaN: the docs say the build refuses both."""
    from validate_pyproject import api

    validator, document = api.Validator(), {"project": {"name": "x", "version": "1"}}
    for model, where in (({"inputs": [{"shape": [2.0]}]}, "inputs[0].shape[0]"), ({"rtol": float("nan")}, "rtol")):
        model = {"factory": "a:b", "inputs": [{"shape": [1]}], **model}
        validator({**document, "tool": {"hatch-aoti": {"models": {"m": model}}}})
        assert f"{M}.m.{where}" in problems({"models": {"m": model}}), where


def test_the_schema_refuses_what_closed_keys_do_not_take() -> None:
    """``weights = "mapd"`` fails in validate-pyproject, before any build, as it fails in the reader."""
    from validate_pyproject import api

    validator, document = api.Validator(), {"project": {"name": "x", "version": "1"}}
    model = {"factory": "a:b", "inputs": [{"shape": [1]}]}
    for table, where in (
        ({"models": {"m": {**model, "weights": "mapd"}}}, "weights"),
        ({"models": {"m": {**model, "optimize": "fast"}}}, "optimize"),
        ({"optimize": "hots", "models": {"m": model}}, "optimize"),
        ({"cpu-target": "x86-64-v5", "models": {"m": model}}, "cpu-target"),
        ({"models": {"m": {**model, "cpu-target": "avx2"}}}, "cpu-target"),
        ({"models": {"m": {**model, "inputs": [{"shape": [1], "dtype": "float33"}]}}}, "dtype"),
        ({"models": {"m": {**model, "device": "gpu"}}}, "device"),
        ({"models": {"m": {**model, "kwargs": {"x": {"shape": [1], "device": "cuda:x"}}}}}, "device"),
    ):
        with pytest.raises(Exception, match=where) as info:
            validator({**document, "tool": {"hatch-aoti": table}})
        assert type(info.value).__name__ in ("ValidationError", "JsonSchemaValueException"), info.value
        assert any(path.endswith(f".{where}") for path in problems(table)), where
    validator({**document, "tool": {"hatch-aoti": {"models": {"m": {**model, "backend": "toy"}}}}})  # open


def test_the_values_the_schema_lists_are_those_the_reader_takes() -> None:
    """Each closed key's choices (or pattern) pass its check, and a value outside them does not."""
    import re

    from hatch_aoti.settings.model import ModelTable, Table
    from hatch_aoti.settings.reader import Problems, toml_keys

    closed = []
    for cls in (Table, ModelTable, TensorSpec, DimSpec):
        for name, f in toml_keys(cls).items():
            meta = f.metadata["key"]
            if meta.choices is None and meta.pattern is None:
                continue
            closed.append(f"{cls.__name__}.{name}")
            taken = list(meta.choices or ()) or ["cpu", "cuda", "cuda:1"]
            for value in [*taken, f"{taken[0]}x"]:
                found = Problems()
                meta.check(value, name, found)
                listed = value in meta.choices if meta.choices else bool(re.match(meta.pattern, value))
                assert listed == (not found.items), (cls.__name__, name, value, found.items)
    assert len(closed) == 8, closed


@pytest.mark.parametrize(
    "model, where, text",
    [
        ({"weights": "external"}, "m.weights-url", 'is required with `weights = "external"`'),
        ({"weights-url": "https://h/{file}"}, "m.weights-url", 'applies only with `weights = "external"`'),
        ({"weights": "external", "weights-url": "ftp://h/{file}"}, "m.weights-url", "must be an https://, http://"),
        ({"weights": "external", "weights-url": "https://h/w.bin"}, "m.weights-url", "must name the weights file"),
        ({"weights": "external", "weights-url": "https://h/{rev}/{file}"}, "m.weights-url", "nothing else in braces"),
        ({"weights": "external", "weights-url": "https://h/{file"}, "m.weights-url", "must name the weights file"),
        ({"weights": "external", "weights-url": "https://h/{file}", "device": "cuda"}, "m.weights", "for CPU models"),
        ({"weights": "external", "weights-url": "https://h/{file}", "backend": "precompile"}, "m.weights", "`aoti`"),
    ],
)
def test_external_weights_are_checked(model: dict, where: str, text: str) -> None:
    found = problems({"models": {"m": {"factory": "a:b", "inputs": [{"shape": [1]}], **model}}})
    assert text in found[f"{M}.{where.removeprefix('m.')}".replace(f"{M}.", f"{M}.m.")], found


def test_external_weights_take_hub_static_and_file_urls() -> None:
    for url in (
        "https://huggingface.co/org/repo/resolve/0123abc/{file}",
        "http://127.0.0.1:8000/{file}",
        "file:///mirror/weights/{file}",
    ):
        raw = {
            "models": {"m": {"factory": "a:b", "inputs": [{"shape": [1]}], "weights": "external", "weights-url": url}}
        }
        (model,) = parse_settings(raw).models
        assert model.weights_url == url
    assert parse_settings(raw).weights_dir == "dist-weights"
