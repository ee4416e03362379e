"""The harness can fail: the doctest report reader finds every kind of failure (a failed CHECK, a
FATAL message, an exception, a case another rank failed), and the Run helpers reject what they
must (a second line beside a usage error, a PASS where a FAIL was planted, output on stdout)."""
import pytest

from conftest import Run
from test_doctest import xml_verdicts

REPORT = """<?xml version="1.0" encoding="UTF-8"?>
<doctest binary="unit_tests" version="2.4.9">
  <TestSuite>
    <TestCase name="passes" filename="a.cpp" line="1">
      <OverallResultsAsserts successes="3" failures="0" test_case_success="true"/>
    </TestCase>
    <TestCase name="a check fails" filename="a.cpp" line="9">
      <Expression success="false" type="CHECK" filename="a.cpp" line="11">
        <Original>x == 2</Original>
        <Expanded>1 == 2</Expanded>
      </Expression>
      <OverallResultsAsserts successes="0" failures="1" test_case_success="false"/>
    </TestCase>
    <TestCase name="a fatal message" filename="a.cpp" line="20">
      <Message type="FATAL ERROR" filename="kernel_check.h" line="92">
        <Text>1 of 1 elements differ</Text>
      </Message>
      <OverallResultsAsserts successes="0" failures="1" test_case_success="false"/>
    </TestCase>
    <TestCase name="throws" filename="a.cpp" line="30">
      <Exception crash="false">boom</Exception>
      <OverallResultsAsserts successes="0" failures="0" test_case_success="false"/>
    </TestCase>
    <TestCase name="skipped" filename="a.cpp" line="40" skipped="true"/>
  </TestSuite>
</doctest>
"""
OTHER_RANK = """<?xml version="1.0" encoding="UTF-8"?>
<doctest binary="mpi_tests" version="2.4.9">
  <TestSuite>
    <TestCase name="passes" filename="a.cpp" line="1">
      <Message type="ERROR" filename="a.cpp" line="5">
        <Text>rank 2's sum differs</Text>
      </Message>
      <OverallResultsAsserts successes="2" failures="1" test_case_success="false"/>
    </TestCase>
  </TestSuite>
</doctest>
"""


def test_the_doctest_reader_finds_every_kind_of_failure():
    v = xml_verdicts(REPORT)
    assert v["passes"] == []
    assert v["a check fails"] == ["a.cpp:11: CHECK( x == 2 ) is CHECK( 1 == 2 )"]
    assert v["a fatal message"] == ["kernel_check.h:92: FATAL ERROR: 1 of 1 elements differ"]
    assert v["throws"] == ["exception: boom"]
    assert "skipped" not in v


def test_the_doctest_reader_fails_a_case_that_another_rank_failed():
    # tests/mpi/main.cpp prints rank 0's report, then each failed rank's lines prefixed "rank R| "
    out = REPORT + "\n".join("rank 2| " + x for x in OTHER_RANK.splitlines()) + "\nmpi_tests: FAILED on rank(s) 2 of 4\n"
    assert xml_verdicts(out)["passes"] == ["rank 2: a.cpp:5: ERROR: rank 2's sum differs"]


def test_a_process_that_reported_nothing_has_no_verdicts():
    assert xml_verdicts("Segmentation fault (core dumped)\n") == {}


@pytest.mark.parametrize("out, rc, check", [
    ("error: --cols 0\nand a second line\n", 2, "usage_error"),    # two lines
    ("error: --cols 0\n", 1, "usage_error"),                         # the wrong exit code
    ("no error prefix\n", 2, "usage_error"),
    ("check: PASS (0 comparisons failed)\n", 0, "fails"),            # a planted bug not caught
    ("check: FAIL (1 comparison failed)\n", 1, "ok"),
    ("check: PASS\n", 1, "ok"),                                     # PASS printed, yet exit 1
], ids=["usage-two-lines", "usage-exit-1", "usage-no-prefix", "planted-bug-passes", "ok-on-fail", "ok-exit-1"])
def test_the_run_helpers_reject_what_they_must(out, rc, check):
    run = Run(["prog"], rc, out)
    with pytest.raises(AssertionError, match="command: prog"):
        getattr(run, check)()


def test_stdout_has_reads_stdout_alone():
    run = Run(["prog"], 0, "check: PASS\n", stdout="", stderr="check: PASS\n")
    with pytest.raises(AssertionError, match="expected stdout to match"):
        run.stdout_has("^check: PASS")
