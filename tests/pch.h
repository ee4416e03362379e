// tests/pch.h — the standard headers and doctest, which most test files include, compiled once
// for all of them.
//
// The Makefile compiles this file into a precompiled header ($(BUILD)/obj/pch/tests.h.gch,
// with the test files' own flags) and every test file of tests/unit and tests/mpi is compiled
// with `-include` of it: GCC then loads the parsed headers instead of reading them again for
// each of some forty files (about 2 s of a test file's compile). Each test file still
// includes what it uses. Only doctest and standard headers are here: they declare nothing
// outside std and doctest, so taking them first changes no file's meaning. Where a file's
// flags differ (OpenMP, say), GCC ignores the precompiled header and reads these headers as
// text.
#ifndef FIVEFOLD_TESTS_PCH_H
#define FIVEFOLD_TESTS_PCH_H

#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#endif  // FIVEFOLD_TESTS_PCH_H
