"""Prints "PASSED FAILED" test-case counts from Bazel's test.xml files.

Usage: count_tests.py BAZEL_TESTLOGS_DIR
Every test target leaves a JUnit XML (test.xml); GoogleTest and our Python
runner list one <testcase> per test. A target whose XML has no test case
(it crashed or could not start) counts as one failure.
"""
import pathlib
import sys
import xml.etree.ElementTree as ET


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    passed = failed = 0
    for xml in sorted(root.rglob("test.xml")):
        try:
            tree = ET.parse(xml)
        except ET.ParseError:
            failed += 1
            continue
        cases = list(tree.iter("testcase"))
        if not cases:
            failed += 1
            continue
        for case in cases:
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.get("status") == "notrun" or case.find("skipped") is not None:
                continue
            else:
                passed += 1
    print(passed, failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
