// common/util/exercise.cpp — see exercise.h.
#include "common/util/exercise.h"

#include <cstdlib>
#include <string>

namespace ff {

namespace {
ExerciseHandler g_handler = nullptr;
}  // namespace

void set_exercise_handler(ExerciseHandler handler) { g_handler = handler; }

void exercise_missing(const char* name, const char* see) {
  const std::string message = std::string("exercise ") + name + " is not written yet (see " + see + ")";
  if (g_handler) g_handler(message.c_str());
  throw ExerciseMissing(message);
}

int exercise_variant(const char* name) {
  const char* grade = std::getenv("FF_GRADE");
  if (!grade) return -1;
  const std::string g = grade, prefix = std::string(name) + "=";
  if (g == "*=0") return 0;  // every stub: the student's copy
  if (g.compare(0, prefix.size(), prefix) != 0) return -1;
  return std::atoi(g.c_str() + prefix.size());
}

}  // namespace ff
