// The single-process unit tests: one doctest binary, build/tests/unit_tests.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
