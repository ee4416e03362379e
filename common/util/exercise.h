// common/util/exercise.h — what a lesson's exercises run on (scripts/exercise.py writes them).
//
// A lesson marks the parts a student writes in its own code:
//     // [exercise:NAME] the task, one line
//     ... the lesson's code: the solution ...
//     // [/exercise]
// and keeps what teaching each needs (hints, planted mistakes, minutes, the runs that grade it)
// in its lessons/NN_name/exercises.json.
// `make exercise L=NN` copies the files that hold a lesson's marks into exercises/NN_name/ with
// every marked region replaced by its task, its hints and a call of exercise_missing; `make run
// L=NN EX=1` builds that copy and runs it, and the lesson's own check grades it.
#pragma once
#include "common/util/error.h"

namespace ff {

// Thrown by exercise_missing when no handler is installed (a program outside the lesson
// skeleton, a unit test).
struct ExerciseMissing : Error {
  using Error::Error;
};

// A region the student has not written yet: the message "exercise NAME is not written yet
// (see SEE)" goes to the handler the lesson's runner installs (common/lesson/lesson.cpp: one
// `error:` line, the job ended with status 2), called right there — a stub may sit where an
// exception must not pass (inside MPI's call of a reduction op, an OpenMP region) — or, with
// none installed, is thrown as ExerciseMissing.
[[noreturn]] void exercise_missing(const char* name, const char* see);
using ExerciseHandler = void (*)(const char* message);  // must not return
void set_exercise_handler(ExerciseHandler handler);

// Grading (scripts/exercise.py grade): which version of exercise `name` a grading build runs,
// from the environment's FF_GRADE=NAME=K — 0 the stub, K >= 1 the solution with its K-th
// planted mistake — and -1, the solution, for any other exercise or without FF_GRADE.
// FF_GRADE=*=0 runs every exercise's stub: the student's copy, as `make exercise` writes it.
int exercise_variant(const char* name);

}  // namespace ff
