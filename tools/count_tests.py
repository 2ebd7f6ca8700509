"""Counts this Bazel invocation's test cases: prints "PASSED FAILED SKIPPED".

Usage: count_tests.py BUILD_EVENTS.json

Reads the build event protocol file of one `bazel test` run
(--build_event_json_file), so only that run's results count, never a
test.xml left behind by an earlier one. For each test target it ran, the
test cases in the JUnit XML the run reports (GoogleTest and our Python
runner list one <testcase> each):
- a case with <failure> or <error> is failed; one marked skipped (GTEST_SKIP,
  unittest's skip) is skipped; every other case passed;
- a target whose result is not PASSED but whose XML shows no failed case (it
  crashed, timed out, or wrote no XML) counts one failure more;
and one failure for every target that failed to build or was never run
because of a failure (an aborted event).
"""
import json
import pathlib
import sys
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET


def count_xml(path: pathlib.Path):
    """(passed, failed, skipped) of one JUnit XML, or None when unreadable."""
    try:
        tree = ET.parse(path)
    except (ET.ParseError, OSError):
        return None
    passed = failed = skipped = 0
    for case in tree.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif (case.find("skipped") is not None or case.get("result") == "skipped"
              or case.get("status") == "notrun"):
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def file_of(uri: str) -> pathlib.Path:
    return pathlib.Path(urllib.request.url2pathname(urllib.parse.urlparse(uri).path))


def count_events(lines):
    passed = failed = skipped = 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        event = json.loads(line)
        ident = event.get("id", {})
        if "testResult" in ident and "testResult" in event:
            result = event["testResult"]
            xml = [o for o in result.get("testActionOutput", []) if o.get("name") == "test.xml"]
            counts = count_xml(file_of(xml[0]["uri"])) if xml else None
            p, f, s = counts if counts is not None else (0, 0, 0)
            if result.get("status") != "PASSED" and f == 0:
                f += 1  # crashed, timed out or no XML: not a pass
            passed += p
            failed += f
            skipped += s
        elif "targetCompleted" in ident and not event.get("completed", {}).get("success", False):
            failed += 1  # did not build
        elif "aborted" in event and ("targetCompleted" in ident or "configuredLabel" in ident
                                      or "testSummary" in ident or "targetConfigured" in ident):
            failed += 1  # never got to run
    return passed, failed, skipped


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: count_tests.py BUILD_EVENTS.json", file=sys.stderr)
        return 2
    try:
        with open(sys.argv[1]) as f:
            passed, failed, skipped = count_events(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"count_tests.py: cannot read the build events: {e}", file=sys.stderr)
        return 1
    print(passed, failed, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
