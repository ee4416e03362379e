# fivefold — one entry point. `make help` lists the targets.
#
#   make            install missing dependencies, build everything into build/
#   make test       build and run the whole test suite (ends with "N passed, N failed")
#   make lessons    run every lesson at its default rank count, with a summary table
#   make run L=01 NP=4 ARGS="--rows 8"   run one lesson
#   make plots      regenerate the figures into plots/out/ from real runs
#   make reference  regenerate the PyTorch golden data in tests/reference/data/
#   make sanitize   ASan/UBSan build of the unit tests and lessons, run clean
#   make clean

BUILD    ?= build
CXX      := mpicxx
OPT      ?= -O2
CXXFLAGS ?= $(OPT) -g
SANFLAGS ?=
FLAGS    := $(CXXFLAGS) $(SANFLAGS) -std=c++17 -Wall -Wextra -I. -MMD -MP -DOMPI_SKIP_MPICXX
LDFLAGS  ?=
LDLIBS   := -lboost_context
# Debian's python, which has matplotlib, numpy and torch (not whatever python3 is first on PATH)
PYTHON   ?= /usr/bin/python3
# mpirun: oversubscribe small machines, allow root in containers, keep the output quiet.
MPIRUN   ?= mpirun --oversubscribe -q $(if $(filter 0,$(shell id -u)),--allow-run-as-root)
export MPIRUN BUILD PYTHON

LIB_SRCS    := $(wildcard kernels/*.cpp kernels/cpu/*.cpp common/*.cpp)
LIB_OBJS    := $(LIB_SRCS:%.cpp=$(BUILD)/obj/%.o)
LIB         := $(BUILD)/lib/libfivefold.a
LESSONS     := $(notdir $(wildcard lessons/[0-9][0-9]_*))
LESSON_BINS := $(LESSONS:%=$(BUILD)/bin/%)
UNIT_SRCS   := $(wildcard tests/unit/*.cpp)
MPI_SRCS    := $(wildcard tests/mpi/*.cpp)
PROG_SRCS   := $(wildcard tests/progs/*.cpp)
PROG_BINS   := $(PROG_SRCS:tests/progs/%.cpp=$(BUILD)/tests/%)
TEST_BINS   := $(BUILD)/tests/unit_tests $(BUILD)/tests/mpi_tests $(PROG_BINS)

.PHONY: all build deps test lessons run plots reference sanitize clean help
.DEFAULT_GOAL := all

all: deps
	@$(MAKE) --no-print-directory build

build: $(LIB) $(LESSON_BINS) $(TEST_BINS)

deps:
	@bash scripts/install-deps.sh

# ---- the core library
$(BUILD)/obj/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(FLAGS) -c $< -o $@

$(LIB): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	ar rcs $@ $^

# ---- lessons: every .cpp of lessons/NN_name/ links into build/bin/NN_name
lesson_objs = $(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard lessons/$(1)/*.cpp))
.SECONDEXPANSION:
$(BUILD)/bin/%: $$(call lesson_objs,$$*) $(LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

# ---- tests
$(BUILD)/tests/unit_tests: $(UNIT_SRCS:%.cpp=$(BUILD)/obj/%.o) $(LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

$(BUILD)/tests/mpi_tests: $(MPI_SRCS:%.cpp=$(BUILD)/obj/%.o) $(LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/progs/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

test: deps
	@$(MAKE) --no-print-directory build
	@bash scripts/run-tests.sh

lessons: deps
	@$(MAKE) --no-print-directory build
	@bash scripts/run-lessons.sh

L  ?= 01
NP ?=
run: deps
	@$(MAKE) --no-print-directory build
	@bash scripts/run-lesson.sh "$(L)" "$(NP)" $(ARGS)

plots: deps
	@$(MAKE) --no-print-directory build
	@bash scripts/make-plots.sh

reference:
	$(PYTHON) tests/reference/ops.py tests/reference/data

# AddressSanitizer + UndefinedBehaviorSanitizer build of everything, then the test suite on it.
sanitize: deps
	@$(MAKE) --no-print-directory build BUILD=build/sanitize OPT=-O1 \
	  SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
	@BUILD=build/sanitize SANITIZE=1 bash scripts/run-tests.sh

clean:
	rm -rf $(BUILD) plots/out

help:
	@sed -n '2,12p' Makefile | sed 's/^# \{0,1\}//'

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
