"""Every environment variable hatch-aoti reads or honours, in one typed list.

The variables are read where they act (the store, the pipeline, the CLI, the generated loader,
which cannot import this package); this list is what ``docs/environment.md`` is generated from
(``python -m hatch_aoti.settings.docs --write``), and a test checks it against the sources, so a
variable cannot be added or dropped without the reference saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Who reads a variable: the build (backend and its processes), the installed wheel's loader, the
#: ``hatch-aoti`` command, or the project's own tests and scripts.
Reader = Literal["build", "loader", "CLI", "tests", "scripts"]
#: Which table of the reference a variable is in.
Group = Literal["users", "others", "contributors"]


@dataclass(frozen=True)
class Variable:
    """One variable: ``name`` ends in ``<MODEL>`` where the model's name, in capitals, completes it."""

    name: str
    read_by: tuple[Reader, ...]
    default: str
    meaning: str
    #: The page (and section) of docs/ that says more; empty where this entry says all.
    doc: str = ""
    group: Group = "users"

    def matches(self, found: str) -> bool:
        """Whether a name found in a source is this variable (any model's, for a ``<MODEL>`` name)."""
        if self.name.endswith("<MODEL>"):
            return found.startswith(self.name.removesuffix("<MODEL>"))
        if self.name.endswith("*"):
            return found.startswith(self.name.removesuffix("*"))
        return found == self.name


VARIABLES: tuple[Variable, ...] = (
    # -- hatch-aoti's own, for its users --------------------------------------------------------------------
    Variable(
        "HATCH_AOTI_CACHE_DIR",
        ("build", "CLI"),
        "the user's cache directory (`~/.cache/hatch-aoti` on Linux)",
        "where the compile cache is kept",
        "performance.md#build-cache",
    ),
    Variable(
        "HATCH_AOTI_CACHE_MAX_SIZE",
        ("build", "CLI"),
        "`20GB`",
        "the compile cache's cap (`512MB`, `2GiB` or bytes); the entries used least recently go first",
        "performance.md#build-cache",
    ),
    Variable(
        "HATCH_AOTI_NO_CACHE",
        ("build",),
        "unset",
        "set (to anything but `0`, `false` or `no`): no compile cache, local or remote, and no key computed",
        "performance.md#build-cache",
    ),
    Variable(
        "HATCH_AOTI_REMOTE_CACHE",
        ("build", "CLI"),
        "unset: no remote tier",
        "the fsspec URL of the compile cache's remote tier, shared by a fleet of builds",
        "remote-cache.md#configuration",
    ),
    Variable(
        "HATCH_AOTI_REMOTE_CACHE_MODE",
        ("build", "CLI"),
        "`read-write`",
        "`read-only` for builds that may fetch from the remote tier but not upload to it (pull requests)",
        "remote-cache.md#configuration",
    ),
    Variable(
        "HATCH_AOTI_REMOTE_CACHE_TIMEOUT",
        ("build", "CLI"),
        "`30`",
        "seconds the remote tier may take to answer; a transfer may take that plus one second per MiB",
        "remote-cache.md#configuration",
    ),
    Variable(
        "HATCH_AOTI_JOBS",
        ("build",),
        "the CPUs the build may use",
        "how many compile helper processes a build runs at once",
        "how-it-works.md#the-build-pipeline",
    ),
    Variable(
        "HATCH_AOTI_PACK",
        ("loader", "build", "CLI"),
        "`convolutions`",
        "which recorded weights `load()` packs for the CPU at hand: `convolutions`, `all` (linear layers "
        "too, a copy in each process) or `none`; int8 weights are packed whatever it says; the build's own "
        "loads and `hatch-aoti inspect` follow it",
        "configuration.md#fast-defaults",
    ),
    Variable(
        "HATCH_AOTI_PRECISION",
        ("loader",),
        "the first variant this CPU runs natively",
        "which variant `load()` takes of every model: `float32`, `bfloat16` or `int8`; a model without it, "
        "or a CPU without native arithmetic for it, is then an error",
        "configuration.md#precision",
    ),
    Variable(
        "HATCH_AOTI_INSTANCES",
        ("loader",),
        "one per CPU",
        "the most instances of a CPU model that calls from several threads run on at once",
        "performance.md#threads",
    ),
    Variable(
        "HATCH_AOTI_WEIGHTS_CACHE",
        ("loader",),
        "`$XDG_CACHE_HOME/hatch-aoti/weights`, else `~/.cache/hatch-aoti/weights`",
        'where the loader keeps the fetched files of `weights = "external"` models',
        "configuration.md#external-weights",
    ),
    Variable(
        "HATCH_AOTI_WEIGHTS_TIMEOUT",
        ("loader",),
        "`30`",
        "seconds a weights fetch waits for the server at a time; the whole fetch has 10 times that plus 1 s per MiB",
        "configuration.md#external-weights",
    ),
    Variable(
        "HATCH_AOTI_WEIGHTS_URL_<MODEL>",
        ("loader",),
        "the URL the wheel's manifest records",
        "where to fetch one model's external weights from instead (a mirror); the sha256 is checked all the same",
        "configuration.md#external-weights",
    ),
    Variable(
        "HATCH_AOTI_VERIFY_TIMEOUT",
        ("CLI",),
        "`900`",
        "seconds `hatch-aoti verify --torch` gives one model's check in another release's environment",
        "torch-window.md#a-window-of-torch-releases",
    ),
    Variable(
        "HATCH_AOTI_DEBUG",
        ("CLI",),
        "unset",
        "set: an unexpected error of the `hatch-aoti` command shows its traceback",
        "cli.md",
    ),
    # -- other projects' variables that hatch-aoti reads or honours ------------------------------------------
    Variable(
        "HF_TOKEN",
        ("loader",),
        "unset",
        "sent as a bearer token with weights fetches from `huggingface.co` URLs only (gated or private repositories)",
        "configuration.md#external-weights",
        "others",
    ),
    Variable(
        "HF_HOME",
        ("loader",),
        "`~/.cache/huggingface`",
        "where the token `hf auth login` saved is read from (`$HF_HOME/token`) when `HF_TOKEN` is unset",
        "configuration.md#external-weights",
        "others",
    ),
    Variable(
        "HF_TOKEN_PATH",
        ("loader",),
        "`$HF_HOME/token`",
        "the file the token is read from when `HF_TOKEN` is unset",
        "configuration.md#external-weights",
        "others",
    ),
    Variable(
        "SSL_CERT_FILE",
        ("loader",),
        "the system's certificates",
        "the certificates a weights fetch over https trusts (as `REQUESTS_CA_BUNDLE` and `CURL_CA_BUNDLE`, "
        "which come first), for hosts behind a proxy that presents its own",
        "guarantees.md#fetched-weights",
        "others",
    ),
    Variable(
        "HF_HUB_OFFLINE",
        ("loader",),
        "unset",
        "set (to anything but `0`): the loader fetches no weights, and says how to fetch them beforehand",
        "configuration.md#external-weights",
        "others",
    ),
    Variable(
        "XDG_CACHE_HOME",
        ("loader",),
        "`~/.cache`",
        "where `HATCH_AOTI_WEIGHTS_CACHE` is by default",
        "configuration.md#external-weights",
        "others",
    ),
    Variable(
        "TORCHINDUCTOR_*",
        ("build",),
        "Inductor's",
        "Inductor's own settings apply to every compile and are part of the cache key (`TORCHINDUCTOR_CACHE_DIR` "
        "aside: each build sets its own)",
        "configuration.md#inductor-settings",
        "others",
    ),
    Variable(
        "SOURCE_DATE_EPOCH",
        ("build",),
        "unset",
        "the wheel's file times, read by hatchling and setuptools: two builds with the same value give "
        "byte-identical wheels",
        "guarantees.md#reproducible-builds",
        "others",
    ),
    Variable(
        "PIP_FIND_LINKS",
        ("build",),
        "unset",
        "read by pip and `python -m build`: a folder of wheels where isolated builds find hatch-aoti",
        "../README.md#getting-hatch-aoti",
        "others",
    ),
    Variable(
        "UV_FIND_LINKS",
        ("build",),
        "unset",
        "the same for `uv build` and `hatch build`",
        "../README.md#getting-hatch-aoti",
        "others",
    ),
    # -- the project's own tests and scripts --------------------------------------------------------------
    Variable(
        "HATCH_AOTI_TEST_WORKERS",
        ("scripts",),
        "`2`",
        "how many processes `scripts/test.sh` runs the suite in; `0` runs it in one",
        "../CONTRIBUTING.md#tests",
        "contributors",
    ),
    Variable(
        "HATCH_AOTI_TEST_VENV",
        ("scripts",),
        "`.venv-test`",
        "the virtual environment `scripts/test.sh` makes afresh and `.ci/run` lints in",
        "../CONTRIBUTING.md#tests",
        "contributors",
    ),
    Variable(
        "HATCH_AOTI_TEST_TORCH",
        ("tests",),
        "`torch==2.13.0`",
        "the torch the tests' runtime venvs install",
        group="contributors",
    ),
    Variable(
        "HATCH_AOTI_TEST_TORCH_NEXT",
        ("tests",),
        "`2.14.1`",
        "the other torch release the torch window's tests install",
        group="contributors",
    ),
    Variable(
        "HATCH_AOTI_TEST_BUILD",
        ("tests",),
        "unset",
        "set by a test on the builds it interrupts, to find their processes",
        group="contributors",
    ),
    Variable(
        "HATCH_AOTI_FAKE",
        ("tests",),
        "`{}`",
        "what the fake build processes of the protocol tests do (JSON)",
        group="contributors",
    ),
    Variable(
        "HATCH_AOTI_LINT_VENV",
        ("scripts",),
        "`.venv-lint`",
        "the virtual environment `scripts/lint.sh` makes on first use",
        "../CONTRIBUTING.md#linting",
        "contributors",
    ),
    Variable(
        "HATCH_AOTI_LINT_IN",
        ("scripts",),
        "unset",
        "an existing virtual environment `scripts/lint.sh` adds the lint tools to and runs them in",
        "../CONTRIBUTING.md#linting",
        "contributors",
    ),
    Variable(
        "HATCH_AOTI_EVENT_FD",
        ("build",),
        "set by the build",
        "the pipe a build's child process writes its events to; never set by hand",
        "how-it-works.md#the-build-pipeline",
        "contributors",
    ),
)

GROUPS: dict[Group, str] = {
    "users": "env:users",
    "others": "env:others",
    "contributors": "env:contributors",
}


def reference(group: Group) -> list[tuple[str, str, str, str]]:
    """(name, read by, default, meaning with its link) of each variable of ``group``, for the docs."""
    rows = []
    for variable in VARIABLES:
        if variable.group != group:
            continue
        meaning = variable.meaning
        if variable.doc:
            meaning += f" ([more]({variable.doc}))"
        rows.append((f"`{variable.name}`", ", ".join(variable.read_by), variable.default, meaning))
    return rows
