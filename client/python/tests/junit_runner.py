"""Runs a test module's unittest cases and writes a JUnit XML report.

When Bazel sets XML_OUTPUT_FILE, the report goes there (one <testcase> per
test, so CI can count them); the last line printed is
"N passed, N failed, N skipped". Usage at the end of a test module:

    if __name__ == "__main__":
        junit_runner.main()
"""
from __future__ import annotations

import os
import sys
import time
import unittest
from typing import Any, List, Optional, Tuple
from xml.sax.saxutils import escape, quoteattr


class _Result(unittest.TextTestResult):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: List[Tuple[unittest.TestCase, str, str, float]] = []
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        self.records.append((test, outcome, detail, time.monotonic() - self._started))

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._record(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._record(test, "passed")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._record(test, "failure", "unexpected success")


def _names(test: Any) -> Tuple[str, str]:
    test_id = test.id() if hasattr(test, "id") else str(test)
    if test_id.startswith("__main__."):  # name the module after its file
        test_id = os.path.splitext(os.path.basename(sys.argv[0]))[0] + test_id[len("__main__"):]
    cls, _, name = test_id.rpartition(".")
    return cls or test_id, name or test_id


def write_xml(path: str, suite_name: str, result: _Result, elapsed: float) -> None:
    counts = {"failure": 0, "error": 0, "skipped": 0}
    cases = []
    for test, outcome, detail, seconds in result.records:
        classname, name = _names(test)
        body = ""
        if outcome in ("failure", "error"):
            counts[outcome] += 1
            first = detail.strip().splitlines()[-1] if detail.strip() else outcome
            body = f"<{outcome} message={quoteattr(first)}>{escape(detail)}</{outcome}>"
        elif outcome == "skipped":
            counts["skipped"] += 1
            body = f"<skipped message={quoteattr(detail)}/>"
        cases.append(f'    <testcase classname={quoteattr(classname)} name={quoteattr(name)} '
                     f'time="{seconds:.3f}">{body}</testcase>')
    n = len(result.records)
    attrs = (f'tests="{n}" failures="{counts["failure"]}" errors="{counts["error"]}" '
             f'skipped="{counts["skipped"]}" time="{elapsed:.3f}"')
    xml = ['<?xml version="1.0" encoding="UTF-8"?>', f"<testsuites {attrs}>",
           f"  <testsuite name={quoteattr(suite_name)} {attrs}>", *cases, "  </testsuite>",
           "</testsuites>", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(xml))


def main(module: str = "__main__", argv: Optional[List[str]] = None) -> None:
    """Runs every test of `module` (or those named in argv / TESTBRIDGE_TEST_ONLY)."""
    argv = sys.argv[1:] if argv is None else argv
    loader = unittest.TestLoader()
    only = os.environ.get("TESTBRIDGE_TEST_ONLY")
    names = argv or ([only] if only else [])
    mod = sys.modules[module]
    suite = loader.loadTestsFromNames(names, mod) if names else loader.loadTestsFromModule(mod)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Result)
    started = time.monotonic()
    result = runner.run(suite)
    elapsed = time.monotonic() - started
    suite_name = os.environ.get("TEST_TARGET") or os.path.basename(sys.argv[0])
    xml_path = os.environ.get("XML_OUTPUT_FILE")
    if xml_path:
        write_xml(xml_path, suite_name, result, elapsed)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    sys.stdout.flush()
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(0 if failed == 0 and result.testsRun > 0 else 1)
