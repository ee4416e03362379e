# fivefold — one entry point. `make help` lists the targets.
#
#   make            install missing dependencies, build everything into build/ (lessons, tests)
#   make test       build and run the whole test suite with pytest (ends with "N passed, N failed")
#   make test L=08  only lesson 08's tests; make test K=zero only the tests whose name says "zero"
#                   (pytest's -k); TEST_JOBS=N tests at a time (default: one per core, and one more); tests/README.md
#   make lessons    build the lessons, run each at its default rank count, with a summary table
#   make run L=01 NP=4 ARGS="--rows 8"   build and run one lesson
#   make exercise L=03   a lesson's exercises to write, in exercises/; make run L=03 EX=1 grades them
#   make grade      every exercise: its stub stops the run, its solution passes, its mistakes fail
#                   (make grade L=03 EX=1: your copy on every run that grades lesson 03's exercises)
#   make plots      regenerate the figures into plots/out/ from real runs
#   make slides     the lesson decks (slides/*.md) -> build/slides/*.html, .pdf, index.html,
#                   with code, outputs and figures from the tree and real runs (it draws the
#                   figures plots/out/ lacks first)
#   make lecture    make plots + make slides
#   make reference  regenerate the PyTorch golden data in tests/reference/data/
#   make sanitize   ASan/UBSan build of the unit tests and lessons, run clean
#   make bench      kernel throughput per device (cpu, sim, cuda when a GPU is present),
#                   lesson 04's all-to-alls as ratios to MPI_Alltoallv, lesson 06's hidden
#                   fraction, lesson 08's training step vs PyTorch and its overlapped pairs
#   make gpu-check  on a machine with a GPU: the cuda kernel tests, make bench and every
#                   lesson with --device cuda, in one report (build/gpu-check.txt)
#   make clean
#
# Options: NO_CUDA=1 (skip nvcc even when found), NVCC=/path/to/nvcc, CUDA_ARCH="80 90"
#          (default: the GPUs here, else 80), NO_NCCL=1 (build without NCCL even when found),
#          NCCL_HOME=/path/to/nccl, NO_CCACHE=1 (compile without ccache even when found),
#          V=1 (print every command in full), -jN (default: every core).

BUILD    ?= build
CXX      := mpicxx
OPT      ?= -O2
# Line tables (-g1), not full debug information: backtraces, addr2line, perf and the sanitizers'
# reports keep their file:line, and a compile takes a third less time than with -g (measured on
# the largest files). To step through a lesson in gdb with its variables: make OPT=-O0 DEBUG=-g
# (after make clean).
DEBUG    ?= -g1
CXXFLAGS ?= $(OPT) $(DEBUG)
# The test programs' own files (tests/unit, tests/mpi, tests/progs) are mostly doctest's macros
# and small reference loops: -O1 compiles them in about half the time of -O2. The code they test
# is compiled as above.
TEST_OPT ?= -O1
SANFLAGS ?=
FLAGS    := $(CXXFLAGS) $(SANFLAGS) -std=c++17 -Wall -Wextra -I. -MMD -MP -DOMPI_SKIP_MPICXX
LDFLAGS  ?=
LDLIBS   := -lboost_context -lz
# Debian's python, which has matplotlib, numpy and torch (not whatever python3 is first on PATH)
PYTHON   ?= /usr/bin/python3
# mpirun: oversubscribe small machines, allow root in containers, keep the output quiet, let a
# run that exits non-zero (bad input, a failed check) end at once (Open MPI 4 otherwise waits
# odls_base_sigkill_timeout, 1 s, twice before it reports the exit status), and take Open MPI's
# own point-to-point layer over shared memory (pml ob1) instead of probing for UCX's network
# fabrics first, which costs 0.2 s a start: a third of a small lesson's run, and of make test.
# --bind-to none: Open MPI binds each of up to two ranks to one core, where the cpu kernels'
# threads (the cores divided among the node's ranks, kernels/README.md) would then share it: one
# rank on a 2-core machine ran its two threads on one core, at two thirds of the speed.
MPIRUN   ?= mpirun --oversubscribe -q --bind-to none --mca odls_base_sigkill_timeout 0 --mca pml ob1 $(if $(filter 0,$(shell id -u)),--allow-run-as-root)
export MPIRUN BUILD PYTHON

# ---- how the build talks and how wide it runs
# One line per compiled or linked file; V=1 prints the commands in full.
V ?= 0
Q   := $(if $(filter 1,$(V)),,@)
say  = $(if $(Q),@printf '  %-5s %s\n' '$(1)' '$(2)')
# Every core unless make is given -jN (which wins over a -j set here). With several goals on one
# command line (`make clean lessons`, `make plots slides`) they run one after another, and each
# one's build runs in a second make, as the main targets' builds do, which takes -j there.
# --output-sync keeps each file's compiler messages together; the second make's jobs share the
# first one's slots.
NPROC   := $(shell nproc 2>/dev/null || echo 2)
ifeq ($(MAKELEVEL):$(filter-out 0 1,$(words $(MAKECMDGOALS))),0:)
MAKEFLAGS += -j$(NPROC)
endif
SUBMAKE_FLAGS = --no-print-directory --output-sync=target $(if $(filter -j%,$(MAKEFLAGS)),,-j$(NPROC))
# ccache (Debian's ccache) when present: a rebuild after `make clean` or in a second clone costs
# little. Never required; NO_CCACHE=1 leaves it out.
NO_CCACHE ?= 0
CCACHE    := $(if $(filter 1,$(NO_CCACHE)),,$(shell command -v ccache 2>/dev/null))

# The emulator build rounds as nvcc's does: nvcc contracts a * b + c into one fused
# multiply-add (its default --fmad=true), so the sim build does too where the CPU has FMA
# (x86-64 since 2013, every aarch64). Then a test tolerance that holds only for two roundings
# fails on sim, not first on a GPU. SIM_FMA=0 turns it off.
ARCH      := $(shell uname -m)
SIM_FMA   ?= $(if $(filter aarch64,$(ARCH)),1,$(if $(shell grep -qw fma /proc/cpuinfo 2>/dev/null && echo y),1,0))
SIM_FLAGS := $(if $(filter 1,$(SIM_FMA)),-ffp-contract=fast $(if $(filter x86_64,$(ARCH)),-mfma))

# The cpu device's kernels (kernels/cpu/) share their work among OpenMP threads (GCC's libgomp):
# OMP_NUM_THREADS sets how many; under mpirun the node's cores are divided among its ranks
# (kernels/README.md). The matmul's tile is written for AVX-512, for AVX2 + FMA and in plain
# C++, and the program picks the best the CPU has when it starts (kernels/cpu/matmul.cpp;
# FF_CPU_ISA=avx2|portable picks a lower one); the row kernels are compiled for the same
# levels by GCC's function multiversioning: no -march flag, the build runs on any x86-64.
# CPU_ISA below names the level for make's messages and make bench's OpenBLAS kernels.
OMP_FLAGS := -fopenmp
LDLIBS    += $(OMP_FLAGS)
CPU_ISA   := $(if $(filter x86_64,$(ARCH)),$(shell f=$$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null); \
               has() { for x in "$$@"; do echo " $$f " | grep -qw "$$x" || return 1; done; }; \
               if has avx512f avx512bw avx512cd avx512dq avx512vl; then echo "AVX-512 (x86-64-v4)"; \
               elif has avx2 fma bmi2 movbe; then echo "AVX2 + FMA (x86-64-v3)"; fi))

LIB_SRCS    := $(wildcard kernels/*.cpp kernels/cpu/*.cpp common/*/*.cpp)
# Every CUDA kernel file compiles twice: with the host compiler against the SIMT emulator
# (device "sim", always), and with nvcc (device "cuda", when nvcc exists).
CUDA_SRCS   := $(wildcard kernels/cuda/*.cu)
LIB_OBJS    := $(LIB_SRCS:%.cpp=$(BUILD)/obj/%.o) $(CUDA_SRCS:%.cu=$(BUILD)/obj/sim/%.o)

# ---- nvcc: found on PATH or in /usr/local/cuda; NO_CUDA=1 opts out
NO_CUDA   ?= 0
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
ifeq ($(NO_CUDA),1)
override NVCC :=
endif
# SASS for each architecture, plus PTX of the last one so newer GPUs can JIT it. Default: the
# GPUs of this machine (nvidia-smi's compute capabilities), else 80 alone (Ampere: its SASS runs
# on A100s, its PTX is JIT-compiled on Hopper and newer). Each architecture adds a device
# compile of every .cu file; CUDA_ARCH="80 90" builds both.
GPU_ARCH  := $(if $(NVCC),$(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d . | grep -x '[0-9][0-9]*' | sort -nu))
CUDA_ARCH ?= $(or $(strip $(GPU_ARCH)),80)
GENCODE   := $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a),code=sm_$(a)) \
             -gencode arch=compute_$(lastword $(CUDA_ARCH)),code=compute_$(lastword $(CUDA_ARCH))
# nvcc may be a wrapper script (e.g. /usr/local/bin/nvcc): ask nvcc itself where its toolkit is
# (the TOP= line of --dryrun), then find the static CUDA runtime there. Without it, no cuda device.
ifneq ($(NVCC),)
CUDA_HOME   := $(realpath $(shell $(NVCC) --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^\#\$$ TOP=//p' | head -n1))
CUDA_LIBDIR := $(firstword $(dir $(wildcard $(CUDA_HOME)/targets/x86_64-linux/lib/libcudart_static.a \
                                            $(CUDA_HOME)/lib64/libcudart_static.a $(CUDA_HOME)/lib/libcudart_static.a)))
ifeq ($(CUDA_LIBDIR),)
NO_CUDA_WHY := nvcc at $(NVCC) but no libcudart_static.a under '$(CUDA_HOME)'
override NVCC :=
endif
endif
ifneq ($(NVCC),)
NVCCFLAGS ?= -O2 -g -lineinfo
LIB_OBJS  += $(CUDA_SRCS:%.cu=$(BUILD)/obj/cuda/%.o) $(BUILD)/obj/cuda/kernels/cuda_runtime.o
FLAGS     += -DFF_HAVE_CUDA=1
LDLIBS    += -L$(CUDA_LIBDIR) -lcudart_static -ldl -lrt -lpthread
endif
# ---- NCCL (with nvcc only): nccl.h and libnccl under NCCL_HOME, else next to the CUDA toolkit,
# else the system's. Only common/comm/nccl.cpp includes it; NO_NCCL=1 opts out.
NO_NCCL   ?= 0
NCCL_HOME ?=
ifneq ($(NVCC),)
ifneq ($(NO_NCCL),1)
NCCL_INCDIR := $(firstword $(dir $(wildcard $(if $(NCCL_HOME),$(NCCL_HOME)/include/nccl.h) \
                 $(CUDA_HOME)/include/nccl.h $(CUDA_HOME)/targets/x86_64-linux/include/nccl.h /usr/include/nccl.h)))
NCCL_LIBDIR := $(firstword $(dir $(wildcard $(if $(NCCL_HOME),$(NCCL_HOME)/lib/libnccl.so $(NCCL_HOME)/lib64/libnccl.so) \
                 $(CUDA_HOME)/lib64/libnccl.so $(CUDA_HOME)/targets/x86_64-linux/lib/libnccl.so \
                 /usr/lib/x86_64-linux-gnu/libnccl.so)))
ifeq ($(NCCL_INCDIR),)
NO_NCCL_WHY := no nccl.h under $(or $(NCCL_HOME),$(CUDA_HOME)) or /usr/include; set NCCL_HOME
else ifeq ($(NCCL_LIBDIR),)
NO_NCCL_WHY := nccl.h in $(NCCL_INCDIR) but no libnccl.so next to it; set NCCL_HOME
else
NCCL_VERSION := $(shell sed -n 's/^\#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' $(NCCL_INCDIR)nccl.h | paste -sd.)
$(BUILD)/obj/common/comm/nccl.o: FLAGS += -DFF_HAVE_NCCL=1 -isystem $(NCCL_INCDIR) -isystem $(CUDA_HOME)/include
LDLIBS += -L$(NCCL_LIBDIR) -lnccl -Wl,-rpath,$(NCCL_LIBDIR)
endif
else
NO_NCCL_WHY := NO_NCCL=1
endif
else
NO_NCCL_WHY := no cuda device in this build
endif
LIB         := $(BUILD)/lib/libfivefold.a
LESSONS     := $(notdir $(wildcard lessons/[0-9][0-9]_*))
LESSON_BINS := $(LESSONS:%=$(BUILD)/bin/%)
UNIT_SRCS   := $(wildcard tests/unit/*.cpp)
MPI_SRCS    := $(wildcard tests/mpi/*.cpp)
PROG_SRCS   := $(wildcard tests/progs/*.cpp)
PROG_BINS   := $(PROG_SRCS:tests/progs/%.cpp=$(BUILD)/tests/%)
TEST_BINS   := $(BUILD)/tests/unit_tests $(BUILD)/tests/mpi_tests $(PROG_BINS)

.PHONY: all build build-lessons run-bin found deps deps-slides deps-test test lessons run plots slides lecture reference sanitize bench gpu-check clean help exercise exercise-bin exercise-syntax grade
.DEFAULT_GOAL := all

all: deps
	@$(MAKE) $(SUBMAKE_FLAGS) build

# What each target needs: the lessons alone for make lessons, run and plots; the tests too for
# make test (and plain make).
build: found $(LIB) $(LESSON_BINS) $(TEST_BINS)
build-lessons: found $(LIB) $(LESSON_BINS)

found:
ifneq ($(NVCC),)
	@echo "✓ nvcc found ($(NVCC)): kernels/cuda/*.cu build for devices sim and cuda (sm $(CUDA_ARCH) + PTX, $(if $(GPU_ARCH),the GPUs here,$(if $(filter command line environment,$(origin CUDA_ARCH)),CUDA_ARCH,no GPU here: CUDA_ARCH=\"80 90\" adds Hopper's SASS)))"
else
	@echo "✗ no cuda device ($(or $(NO_CUDA_WHY),$(if $(filter 1,$(NO_CUDA)),NO_CUDA=1,nvcc not found))): building devices cpu and sim only"
endif
ifneq ($(NCCL_VERSION),)
	@echo "✓ nccl found (version $(NCCL_VERSION), $(NCCL_LIBDIR)libnccl.so): --backend nccl moves cuda tensors GPU to GPU"
else
	@echo "✗ no nccl ($(NO_NCCL_WHY)): every message goes through MPI"
endif
ifneq ($(CPU_ISA),)
	@echo "✓ cpu matmul runs its $(CPU_ISA) kernels here, picked at run time (the build runs on any x86-64)"
else
	@echo "✗ cpu matmul runs its portable kernels (no AVX2 + FMA found on this CPU): the same bits, slower"
endif
ifeq ($(SIM_FMA),1)
	@echo "✓ sim fuses a * b + c into one FMA, as nvcc does ($(SIM_FLAGS))"
else
	@echo "✗ sim rounds a * b + c twice (no FMA on this CPU, or SIM_FMA=0); nvcc fuses it"
endif
ifneq ($(CCACHE),)
	@echo "✓ ccache found ($(CCACHE)): compiles are cached across clean builds"
endif

deps:
	@bash scripts/install-deps.sh
# make test and make slides also build the decks, with Marp from the npm registry
deps-slides:
	@FIVEFOLD_WITH_SLIDES=1 bash scripts/install-deps.sh
# make test also loads a lesson 08 checkpoint into the PyTorch reference model
deps-test:
	@FIVEFOLD_WITH_SLIDES=1 FIVEFOLD_WITH_TORCH=1 FIVEFOLD_WITH_TESTS=1 bash scripts/install-deps.sh

# ---- the core library
$(BUILD)/obj/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(call say,CXX,$<)
	$(Q)$(CCACHE) $(CXX) $(FLAGS) -c $< -o $@

# The course's files (data/) are found from the executable, or else from the tree it was built
# from (common/util/files.h: course_data_file), so a lesson runs from any directory.
$(BUILD)/obj/common/util/files.o: FLAGS += -DFF_SOURCE_DIR='"$(CURDIR)"'

# -fno-trapping-math: nothing here reads the floating-point exception flags, and without it GCC
# will not turn a ternary on doubles (exp_double's clamps, kernels/cpu/row_math.h) into a
# vector select, so the exp loops of the softmax and cross-entropy would not vectorise. It
# changes no result.
# -ffp-contract=off: the compiler fuses no a * b + c on its own in kernels/cpu/, so a kernel
# computes the same bits in every clone (AVX-512, AVX2 + FMA, baseline) and every build (the
# sanitizer's -O1 included), and the outputs the READMEs show do not depend on the machine. The
# matmul fuses its terms explicitly (intrinsics, std::fma: the same bits everywhere; kernels/
# README.md says why and what it gains); the row kernels' double sums may still differ in a
# float's last bit, rarely (kernels/README.md).
$(BUILD)/obj/kernels/cpu/%.o: FLAGS += $(OMP_FLAGS) -fno-trapping-math -ffp-contract=off

# the emulator build of a .cu file: ordinary C++ against kernels/simt.h
$(BUILD)/obj/sim/%.o: %.cu
	@mkdir -p $(dir $@)
	$(call say,SIM,$<)
	$(Q)$(CCACHE) $(CXX) $(FLAGS) $(SIM_FLAGS) -x c++ -c $< -o $@

# the nvcc build of a .cu file
$(BUILD)/obj/cuda/%.o: %.cu
	@mkdir -p $(dir $@)
	$(call say,NVCC,$<)
	$(Q)$(CCACHE) $(NVCC) $(NVCCFLAGS) -std=c++17 -I. $(GENCODE) -MMD -MP -c $< -o $@

$(LIB): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	$(call say,AR,$@)
	$(Q)rm -f $@ && ar rcs $@ $^

# ---- lessons: every .cpp of lessons/NN_name/ links into build/bin/NN_name, with the lesson's
# own .cu kernels built for sim (and for cuda when nvcc exists), and the files of other lessons
# it uses: found from the #include lines, not kept by hand. A source that includes
# lessons/MM_x/y.h links y's object (y.cpp, or y.cu's kernels), and whatever y.h and y.cpp
# include in turn. (A later lesson may include an earlier lesson's header, never the other way,
# never a main.cpp; lesson 06's last table is the one look ahead, tests/check_layers.py.)
# lesson_incs: the lessons/ headers the files $(1) include, as stems (lessons/08_mesh/manifest)
lesson_incs = $(patsubst %.h,%,$(shell sed -n 's|^\#include "\(lessons/[^"]*\.h\)".*|\1|p' $(1) /dev/null))
# lesson_closure: $(2) and every stem reached from the stems $(1), transitively
lesson_closure = $(if $(1),$(call lesson_closure,$(filter-out $(2) $(1),$(sort $(call lesson_incs,$(wildcard \
                   $(addsuffix .h,$(1)) $(addsuffix .cpp,$(1)) $(addsuffix .cu,$(1)))))),$(2) $(1)),$(2))
# stem_objs: the objects of the stems $(1), a .cpp's or a .cu's (sim, and cuda with nvcc)
stem_objs = $(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard $(addsuffix .cpp,$(1)))) \
            $(patsubst %.cu,$(BUILD)/obj/sim/%.o,$(wildcard $(addsuffix .cu,$(1)))) \
            $(if $(NVCC),$(patsubst %.cu,$(BUILD)/obj/cuda/%.o,$(wildcard $(addsuffix .cu,$(1)))))
# included_objs: the objects of the lessons' files that the sources $(1) use, but their own
included_objs = $(call stem_objs,$(filter-out $(basename $(1)),$(call lesson_closure,$(sort $(call lesson_incs,$(1))))))
lesson_srcs = $(wildcard lessons/$(1)/*.cpp lessons/$(1)/*.cu)
lesson_objs = $(call stem_objs,$(basename $(call lesson_srcs,$(1)))) $(call included_objs,$(call lesson_srcs,$(1)))
# Keep every object (make would delete the lessons' and programs' as intermediates).
.SECONDARY:
.SECONDEXPANSION:
$(BUILD)/bin/%: $$(call lesson_objs,$$*) $(LIB)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)
	$(Q)$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

# ---- exercises (scripts/exercise.py): EXDIR holds the copies of a lesson's marked files that
# a student writes (exercises/NN_name, or a grading copy under build/grade); its files.mk says
# which of the lesson's files they stand in for. The binary is the lesson's objects with those
# swapped for the copies'; a copy of a library file (common/...) comes before the library on the
# link line and defines every symbol of the original, so the library's own is not taken.
EXDIR ?=
ifneq ($(EXDIR),)
-include $(EXDIR)/files.mk
ifeq ($(EX_LESSON),)
$(error EXDIR=$(EXDIR) holds no exercise copy (make exercise L=NN writes one))
endif
EX_BIN  := $(BUILD)/ex/$(subst /,_,$(EXDIR))
EX_OBJS := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(filter %.cpp,$(EX_COPIES))) \
           $(patsubst %.cu,$(BUILD)/obj/sim/%.o,$(filter %.cu,$(EX_COPIES))) \
           $(if $(NVCC),$(patsubst %.cu,$(BUILD)/obj/cuda/%.o,$(filter %.cu,$(EX_COPIES)))) \
           $(filter-out $(patsubst %.cpp,$(BUILD)/obj/%.o,$(EX_REPLACES)) \
                        $(patsubst %.cu,$(BUILD)/obj/sim/%.o,$(EX_REPLACES)) \
                        $(patsubst %.cu,$(BUILD)/obj/cuda/%.o,$(EX_REPLACES)),$(call lesson_objs,$(EX_LESSON)))
# a copy of a cpu kernel's file compiles as kernels/cpu/ does (OpenMP, no contraction)
EX_CPU_KERNELS := $(foreach f,$(filter %.cpp,$(EX_COPIES)),$(if $(findstring /kernels/cpu/,$(f)),$(f)))
$(patsubst %.cpp,$(BUILD)/obj/%.o,$(EX_CPU_KERNELS)): FLAGS += $(OMP_FLAGS) -fno-trapping-math -ffp-contract=off
$(EX_BIN): $(EX_OBJS) $(LIB)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)
	$(Q)$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)
endif
exercise-bin: $(EX_BIN)
	@$(if $(EXDIR),:,echo "error: make exercise-bin EXDIR=DIR (a copy make exercise L=NN writes)" >&2; exit 2)
# the copies compiled as exercise-bin compiles them, to the compiler's checks only (-fsyntax-only:
# no code, no link): the grader's look at the student's copy, whose run is the grading build's
# with every stub (FF_GRADE=*=0)
exercise-syntax:
	@$(if $(EXDIR),:,echo "error: make exercise-syntax EXDIR=DIR (a copy make exercise L=NN writes)" >&2; exit 2)
	@$(if $(filter-out %.cpp,$(EX_COPIES)),echo "error: make exercise-syntax checks .cpp copies only (not $(filter-out %.cpp,$(EX_COPIES)))" >&2; exit 2)
	$(Q)$(foreach f,$(filter %.cpp,$(EX_COPIES)),$(CXX) $(filter-out -MMD -MP,$(FLAGS)) \
	  $(if $(findstring /kernels/cpu/,$(f)),$(OMP_FLAGS) -fno-trapping-math -ffp-contract=off) -fsyntax-only $(f) &&) :

# ---- tests
# (private: a target's variables would reach what it depends on, the precompiled header below)
$(BUILD)/obj/tests/unit/%.o $(BUILD)/obj/tests/mpi/%.o $(BUILD)/obj/tests/progs/%.o: private FLAGS += $(TEST_OPT)
# tests/pch.h precompiled once with the doctest suites' flags, and taken first by each of their
# test files (GCC reads the .gch beside the -include'd copy; a file whose flags differ reads
# the text); not by the two main.cpp, which compile doctest's implementation. ccache caches
# the header and such compiles when told the header's macros and times may differ.
TEST_PCH    := $(BUILD)/obj/pch/tests.h
TEST_OBJS   := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(filter-out %/main.cpp,$(UNIT_SRCS) $(MPI_SRCS)))
comma       := ,
PCH_CCACHE  := $(if $(CCACHE),CCACHE_SLOPPINESS=pch_defines$(comma)time_macros $(CCACHE))
$(TEST_OBJS): private FLAGS += -include $(TEST_PCH)
$(TEST_OBJS): private CCACHE := $(PCH_CCACHE)
$(TEST_OBJS): $(TEST_PCH).gch
$(TEST_PCH).gch: tests/pch.h
	@mkdir -p $(dir $@)
	$(call say,PCH,$<)
	$(Q)cp $< $(TEST_PCH)
	$(Q)$(PCH_CCACHE) $(CXX) $(FLAGS) $(TEST_OPT) -x c++-header -c $(TEST_PCH) -o $@
$(BUILD)/obj/tests/unit/test_cpu_exp.o: private FLAGS += $(OMP_FLAGS)  # it includes kernels/cpu/row_math.h
# its scalar reference loops must round as kernels/cpu does (no fused a * b + c): a bitwise test
$(BUILD)/obj/tests/unit/test_kernels_moe.o: private FLAGS += -ffp-contract=off
# the lessons' code that the tests cover directly (lesson 01's kernels, 07's schedules, 08's memory
# and communication model and its checkpoints' manifest, 09's caches), from their #include lines
$(BUILD)/tests/unit_tests: $(UNIT_SRCS:%.cpp=$(BUILD)/obj/%.o) $(call included_objs,$(UNIT_SRCS)) $(LIB)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)
	$(Q)$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

$(BUILD)/tests/mpi_tests: $(MPI_SRCS:%.cpp=$(BUILD)/obj/%.o) $(call included_objs,$(MPI_SRCS)) $(LIB)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)
	$(Q)$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/progs/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)
	$(Q)$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS)

# ---- make bench: kernel throughput per device (built on demand, not part of make test).
# The cpu matmul is timed against OpenBLAS's cblas_sgemm (Debian's libopenblas-dev, installed
# by make bench when missing, as root), linked into the bench only: the lessons stay BLAS-free.
BENCH_OBJS := $(BUILD)/obj/tests/bench/bench_kernels.o \
              $(if $(NVCC),$(BUILD)/obj/cuda/tests/bench/cublas_reference.o)
$(BUILD)/obj/tests/bench/bench_kernels.o: FLAGS += $(OMP_FLAGS)
$(BUILD)/tests/bench_kernels: $(BENCH_OBJS) $(LIB)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)
	$(Q)$(CXX) $(FLAGS) $^ -o $@ $(LDFLAGS) $(LDLIBS) -lopenblas $(if $(NVCC),-lcublas)

# Debian's OpenBLAS 0.3.21 picks its kernels by CPU model and falls back to generic SSE3 ones
# ("Prescott", ~5x slower) on models newer than it knows; OPENBLAS_CORETYPE, set in a user's
# environment, can pick lower ones still (Haswell's on an AVX-512 CPU measured 1.6x slower). A
# reference is timed at its best: the bench gives OpenBLAS (and PyTorch, which runs its matrix
# products in it) the kernels of this CPU's best instruction set, whatever the environment sets,
# and clears OPENBLAS_L2_SIZE; it prints the kernels each side runs and gives no ratio where they
# differ. The AVX2 rows on an AVX-512 CPU are labelled as such, both sides on AVX2.
BLAS_CORETYPE := $(if $(findstring AVX-512,$(CPU_ISA)),SkylakeX,$(if $(findstring AVX2,$(CPU_ISA)),Haswell))
BLAS_ENV      := env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(if $(BLAS_CORETYPE),OPENBLAS_CORETYPE=$(BLAS_CORETYPE))
BLAS_AVX2_ENV := env -u OPENBLAS_L2_SIZE FF_CPU_ISA=avx2 OPENBLAS_CORETYPE=Haswell
bench: deps
	@FIVEFOLD_WITH_OPENBLAS=1 FIVEFOLD_WITH_TORCH=1 bash scripts/install-deps.sh
	@$(MAKE) $(SUBMAKE_FLAGS) build-lessons $(BUILD)/tests/bench_kernels
	$(BLAS_ENV) $(BUILD)/tests/bench_kernels
	$(if $(findstring AVX-512,$(CPU_ISA)),@echo "the cpu matmul and grouped GEMMs again with the AVX2 kernels on both sides (what a CPU without AVX-512 runs)")
	$(if $(findstring AVX-512,$(CPU_ISA)),$(BLAS_AVX2_ENV) $(BUILD)/tests/bench_kernels --matmul-only)
	@echo "the cpu row kernels at 256 x 1024 against PyTorch eager float32 (ratio > 1: fivefold faster)"
	$(PYTHON) tests/bench/bench_rows.py --bench $(BUILD)/tests/bench_kernels
	@for np in 2 4; do $(MPIRUN) -np $$np $(BUILD)/bin/04_gshard --bench --reps 50 || exit 1; done
	$(MPIRUN) -np 8 $(BUILD)/bin/05_deepseek_moe --link intra=160GB/s,inter=50GB/s,latency=3us --reps 20
	@echo "lesson 06: the hidden fraction at the default shape, --progress test and thread (target >= 80%)"
	@for p in test thread; do out=$$($(MPIRUN) -np 4 $(BUILD)/bin/06_overlap --progress $$p --reps 3) || \
	  { echo "$$out"; exit 1; }; echo "$$out" | sed -n "/^  rank  compute/,/^     3 /p; \
	  s/^hidden fraction/--progress $$p: hidden fraction/p"; done
	@echo "lesson 08: one training step of the single-process model, tokens/s, against PyTorch (targets: >= 1.0 at d 64, >= 0.7 at d 256; cpu kernels: $(CPU_ISA))"
	$(BLAS_ENV) $(PYTHON) tests/bench/bench_08.py --lesson $(BUILD)/bin/08_mesh
	$(BLAS_ENV) $(PYTHON) tests/bench/bench_08.py --lesson $(BUILD)/bin/08_mesh --dim 256 --batch 16 --seq 64
	$(if $(findstring AVX-512,$(CPU_ISA)),@echo "lesson 08's step again with the AVX2 kernels on both sides (FF_CPU_ISA=avx2, OpenBLAS's Haswell kernels)")
	$(if $(findstring AVX-512,$(CPU_ISA)),$(BLAS_AVX2_ENV) $(PYTHON) tests/bench/bench_08.py --lesson $(BUILD)/bin/08_mesh)
	$(if $(findstring AVX-512,$(CPU_ISA)),$(BLAS_AVX2_ENV) $(PYTHON) tests/bench/bench_08.py --lesson $(BUILD)/bin/08_mesh --dim 256 --batch 16 --seq 64)
	@echo "lesson 08: dualpipev's F&B pairs overlapped at their all-to-alls vs one after the other (--overlap compare), links modelled: the hidden fraction (target >= 0.7)"
	bash tests/bench/bench_08_overlap.sh $(BUILD)/bin/08_mesh 5
	@echo "lesson 08: checkpoint write and read throughput against a plain copy of the same bytes (d 256, 4 blocks, DP 2 x TP 2)"
	bash tests/bench/bench_08_checkpoint.sh $(BUILD)/bin/08_mesh 3
	@echo "lesson 08: DP's gradient reduction in buckets during the backward: one bucket (posted when the backward ends), 4 and 13 (dp 4, ZeRO-2, links modelled at 100 MB/s), the hidden fraction"
	@for mb in 100 0.1 0.02; do out=$$($(MPIRUN) -np 4 $(BUILD)/bin/08_mesh --tp 1 --zero 2 --bucket-mb $$mb --train 10 \
	  --check-every 100 --link intra=100MB/s,inter=100MB/s,latency=20us) || { echo "$$out"; exit 1; }; \
	  echo "$$out" | sed -n "s/^DP's gradients in buckets of about/  --bucket-mb $$mb: buckets of about/p; s/^  per step: /    /p"; done
	@echo "lesson 09: decode tokens/s at batch 1 and 8 and the memory bandwidth a step uses (seed 002's measure), float32 and int8 weights"
	bash tests/bench/bench_09_decode.sh $(BUILD)/bin/09_inference

# make test: every test under pytest (tests/, pytest.ini; the doctest suites' cases as items),
# TEST_JOBS at a time (pytest-xdist), the long ones first. L=NN: lesson NN's tests only (its pytest
# file, its doctest cases, exercises, README blocks, bad input); K=EXPR: pytest's -k EXPR. Ends
# with "N passed, N failed"; JUnit XML in $(BUILD)/test-results.xml.
# TEST_JOBS: one per core and one more. A test spends part of its time waiting (mpirun starting
# its ranks, ranks waiting on each other, a stub's one-second hold), and the extra one fills
# the cores then: on 2 cores the suite took 367 s with 3 at a time, 496 s with 2, 400 s with 4.
TEST_JOBS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) + 1 )))
PYTEST = $(PYTHON) -m pytest -n $(TEST_JOBS) -q --durations=10 --junitxml=$(BUILD)/test-results.xml \
  $(if $(filter command line environment,$(origin L)),--lesson $(L)) $(if $(K),-k "$(K)")
test: deps-test
	@$(MAKE) $(SUBMAKE_FLAGS) build
	@$(PYTEST)

# everything that needs a GPU, in one report (build/gpu-check.txt); without a GPU: says so, exit 0
gpu-check: deps
	@$(MAKE) $(SUBMAKE_FLAGS) build
	@bash scripts/gpu-check.sh

lessons: deps
	@$(MAKE) $(SUBMAKE_FLAGS) build-lessons
	@bash scripts/run-lessons.sh

# make run builds the one lesson it runs (a lesson that does not exist: run-lesson.sh says so);
# EX=1 builds and runs the student's copy in exercises/ instead (make exercise L=NN writes it)
L  ?= 01
NP ?=
EX ?=
RUN_BIN := $(addprefix $(BUILD)/bin/,$(notdir $(firstword $(wildcard lessons/$(L)_*))))
run-bin: $(RUN_BIN)
	@:
run: deps
ifeq ($(EX),1)
	@d=$$(ls -d $(EXERCISES)/$(L)_* 2>/dev/null | head -n 1); \
	  if [ -z "$$d" ]; then echo "error: no $(EXERCISES)/$(L)_*: make exercise L=$(L) writes the lesson's exercises" >&2; exit 2; fi; \
	  $(PYTHON) scripts/exercise.py stale $$d; \
	  $(MAKE) $(SUBMAKE_FLAGS) found exercise-bin EXDIR=$$d && \
	  FF_RUN_BIN=$(BUILD)/ex/$$(echo $$d | tr / _) bash scripts/run-lesson.sh "$(L)" "$(NP)" $(ARGS)
else
	@$(MAKE) $(SUBMAKE_FLAGS) found run-bin
	@bash scripts/run-lesson.sh "$(L)" "$(NP)" $(ARGS)
endif

# make exercise L=NN: the lesson's exercises, to write, in exercises/NN_name/ (FORCE=1 starts
# an edited copy over; EXERCISES=DIR writes them elsewhere, and make run EX=1 reads them
# there); make grade: every exercise's stub, solution and planted mistakes; make grade L=NN
# EX=1: the student's copy on every run that grades the lesson's exercises
EXERCISES ?= exercises
exercise:
	@FF_EXERCISES=$(EXERCISES) $(PYTHON) scripts/exercise.py make "$(L)" $(if $(filter 1,$(FORCE)),--force)
grade: deps
	@$(MAKE) $(SUBMAKE_FLAGS) build-lessons
ifeq ($(EX),1)
	@FF_EXERCISES=$(EXERCISES) $(PYTHON) scripts/exercise.py mine "$(L)"
else
	@$(PYTHON) scripts/exercise.py grade
endif

# PLOTS="02 05" draws those lessons' figures only
plots: deps
	@$(MAKE) $(SUBMAKE_FLAGS) build-lessons
	@bash scripts/make-plots.sh $(PLOTS)

# Needs Chromium (Debian's chromium, installed here when missing, as root) for PDF and PNG.
# DECKS="02 05" builds those decks only; a figure they show that plots/out/ lacks is drawn
# first (scripts/make-plots.sh for its lesson).
slides: deps-slides
	@FIVEFOLD_WITH_CHROMIUM=1 bash scripts/install-deps.sh
	@$(MAKE) $(SUBMAKE_FLAGS) build-lessons
	$(PYTHON) scripts/slides.py build $(DECKS)

lecture: plots
	@$(MAKE) --no-print-directory slides

# Needs PyTorch (Debian's python3-torch): installed here when missing, as root.
reference:
	@FIVEFOLD_WITH_TORCH=1 bash scripts/install-deps.sh
	$(PYTHON) tests/reference/ops.py tests/reference/data
	$(PYTHON) tests/reference/dsv3_moe.py tests/reference/data
	$(PYTHON) tests/reference/adamw.py tests/reference/data
	$(PYTHON) tests/reference/model.py tests/reference/data

# AddressSanitizer + UndefinedBehaviorSanitizer build of everything, then the test suite on it.
# The emulator tells ASan about its fiber switches, so the sim kernels run sanitized too. The
# cuda device is left out (NO_CUDA=1): ASan's shadow memory and the CUDA driver do not mix.
# (the tests get the build's variables too: make grade builds the exercises with them)
SANITIZE_VARS := BUILD=build/sanitize OPT=-O1 NO_CUDA=1 \
  SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
# Address, undefined-behaviour and leak errors fail the test. Open MPI keeps allocations for the
# life of the process (scripts/lsan.supp names its libraries); the slow unwinder is needed so that
# frames inside its dlopen'ed components can be matched by name.
SANITIZE_RUNTIME := ASAN_OPTIONS=halt_on_error=1:fast_unwind_on_malloc=0 \
  LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/lsan.supp:print_suppressions=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
sanitize: deps
	@$(MAKE) $(SUBMAKE_FLAGS) build $(SANITIZE_VARS)
	@$(SANITIZE_VARS) $(SANITIZE_RUNTIME) SANITIZE=1 $(PYTEST)

clean:
	rm -rf $(BUILD) plots/out

help:
	@sed -n '2,/^$$/p' Makefile | sed 's/^# \{0,1\}//'

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
