// common/util/exercise.cpp — see exercise.h.
#include "common/util/exercise.h"

#include <cstdlib>
#include <string>

namespace ff {

void exercise_missing(const char* name, const char* see) {
  throw ExerciseMissing(std::string("exercise ") + name + " is not written yet (see " + see + ")");
}

int exercise_variant(const char* name) {
  const char* grade = std::getenv("FF_GRADE");
  if (!grade) return -1;
  const std::string g = grade, prefix = std::string(name) + "=";
  if (g.compare(0, prefix.size(), prefix) != 0) return -1;
  return std::atoi(g.c_str() + prefix.size());
}

}  // namespace ff
