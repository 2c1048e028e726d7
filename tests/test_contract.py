"""Outcome contract (test family 19): every public call returns a correct result or raises a
SeqpackError, never another exception, a crash or a hang.

The hypothesis cases live in ``contract_cases.py`` (the core API) and
``contract_integration_cases.py`` (``seqpack.torch``, ``seqpack.hf`` and the exports) and
run here in a subprocess, so that a segfault or a hang fails this test instead of ending
the session. The child caps its address space first: a runaway allocation then fails as a
``MemoryError`` (a violation) instead of exhausting the machine.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("contract_cases.py")
MIN_CASES = 3000  # a passing run executes about 4500
INTEGRATION_CASES = Path(__file__).with_name("contract_integration_cases.py")
INTEGRATION_MIN_CASES = 1300  # a passing run executes about 1750
TIMEOUT_SECONDS = 300  # a passing run takes under a minute
ADDRESS_SPACE_BYTES = 4 * 2**30
RUN_LIMITED = (
    "import resource, sys, pytest; "
    "resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1]))); "
    "sys.exit(pytest.main(sys.argv[2:]))"
)


def run_cases(cases: Path, min_cases: int, tmp_path: Path) -> None:
    """Run the hypothesis cases of ``cases`` in a memory-capped subprocess: every case must
    pass, at least ``min_cases`` must run, and each property must both return and reject."""
    command = [sys.executable, "-c", RUN_LIMITED, str(ADDRESS_SPACE_BYTES),
               "-q", "-p", "no:cacheprovider", "--tb=short", str(cases)]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, cwd=tmp_path,
                             check=False)
    except subprocess.TimeoutExpired as hang:
        output = hang.stdout.decode() if isinstance(hang.stdout, bytes) else hang.stdout or ""
        pytest.fail(f"the contract cases of {cases.name} hung: no result after {TIMEOUT_SECONDS} s\n{output}")
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"exit status {run.returncode} (negative: killed by that signal)\n{output}"
    total = re.search(r"^contract cases: (\d+)$", run.stdout, re.MULTILINE)
    assert total, f"no case count reported\n{output}"
    print(total.group(0))
    assert int(total.group(1)) >= min_cases
    for name, returned, rejected in re.findall(r"^(test_\w+): returned (\d+), rejected (\d+)$", run.stdout,
                                               re.MULTILINE):
        assert int(returned) and int(rejected), f"{name} returned {returned} and rejected {rejected} cases"


@pytest.mark.slow
@pytest.mark.kernel  # hostile calls into every kernel: wanted under the bounds-checked build too
def test_every_call_returns_a_correct_result_or_raises_a_seqpack_error(tmp_path):
    run_cases(CASES, MIN_CASES, tmp_path)


MISSING_FOR_INTEGRATION = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING_FOR_INTEGRATION), reason=f"the integration cases need "
                    f"{' and '.join(MISSING_FOR_INTEGRATION)}: pip install 'seqpack[hf]'")
def test_every_integration_call_returns_a_correct_result_or_raises_a_seqpack_error(tmp_path):
    run_cases(INTEGRATION_CASES, INTEGRATION_MIN_CASES, tmp_path)
