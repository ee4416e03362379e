"""--backend nccl: the tensors' collectives go to NCCL (emulated on device sim here; on cuda where
there is a GPU per rank), every check still PASSes, and NCCL's path changes no number."""

import pytest

from conftest import passes_on_stdout, same_tree

# NCCL ran at least one launch on every rank: the tensors' collectives went to it, not to MPI
NCCL_RAN = r"NCCL (\(emulated\)|[0-9.]+) ran [1-9][0-9]* to [0-9]+ launches per rank"
SMALL_08 = ["--train", 2, "--dim", 32, "--ffn", 32, "--batch", 4, "--seq", 16]


@pytest.mark.lesson("04")
def test_04_the_routers_gradient_all_reduces_on_nccl(lesson):
    # P=3 with 6 experts, P=2
    passes_on_stdout(lesson("04_gshard", 3, "--device", "sim", "--backend", "nccl", "--experts", 6, separate=True))
    passes_on_stdout(lesson("04_gshard", 2, "--device", "sim", "--backend", "nccl", separate=True)).has(NCCL_RAN)


@pytest.mark.lesson("05")
def test_05_the_gradient_all_reduces_on_nccl(lesson):
    # P=3 with 6 experts, P=2
    passes_on_stdout(lesson("05_deepseek_moe", 3, "--device", "sim", "--backend", "nccl", "--batch", 1, "--experts", 6,
                            separate=True))
    passes_on_stdout(lesson("05_deepseek_moe", 2, "--device", "sim", "--backend", "nccl", "--batch", 1,
                            separate=True)).has(NCCL_RAN)


@pytest.mark.lesson("06")
def test_06_the_blocks_gradient_all_reduces_on_nccl(lesson):
    passes_on_stdout(lesson("06_overlap", 2, "--device", "sim", "--backend", "nccl", "--reps", 1, "--tokens", 16,
                            "--dim", 32, "--ffn", 32, "--microbatches", 3, separate=True)).has(NCCL_RAN)


@pytest.mark.long
@pytest.mark.lesson("08")
@pytest.mark.parametrize("np_, mesh", [
    (2, ["--tp", 2]), (2, ["--tp", 2, "--ep", 2]), (4, ["--tp", 2, "--cp", 2]), (4, ["--tp", 2, "--pp", 2, "--layers", 2]),
    (4, ["--tp", 2, "--pp", 2, "--layers", 2, "--schedule", "dualpipe"]),
], ids=["tp2", "tp2-ep2", "tp2-cp2", "tp2-pp2", "tp2-pp2-dualpipe"])
def test_08_tps_all_reduces_gathers_and_scatters_on_nccl(lesson, np_, mesh):
    passes_on_stdout(lesson("08_mesh", np_, "--device", "sim", "--backend", "nccl", *mesh, *SMALL_08,
                            separate=True)).has(NCCL_RAN)


@pytest.mark.long
@pytest.mark.lesson("08")
def test_08_nccl_and_mpi_dump_the_same_bits(lesson, tmp_path):
    # tp2 + SP, ep2: NCCL's path changes no number
    dumps = {}
    for backend in ("nccl", "mpi"):
        dumps[backend] = tmp_path / f"d08{backend[0]}"
        lesson("08_mesh", 2, "--device", "sim", "--backend", backend, "--ep", 2, *SMALL_08, "--dump", dumps[backend]).ok()
    same_tree(dumps["nccl"], dumps["mpi"])


@pytest.mark.parametrize("name", [
    pytest.param("01_online_softmax", marks=pytest.mark.lesson("01")),
    pytest.param("02_ring_attention", marks=pytest.mark.lesson("02")),
    pytest.param("07_dualpipe", marks=pytest.mark.lesson("07")),
])
def test_host_buffer_lessons_pass_and_their_messages_stay_on_mpi(lesson, name):
    # their messages are on host buffers, so MPI's: 0 NCCL launches
    passes_on_stdout(lesson(name, 2, "--device", "sim", "--backend", "nccl", separate=True)) \
        .has(r"NCCL \(emulated\) ran 0 to 0 launches")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.lesson(n[:2]))
                                  for n in ("04_gshard", "05_deepseek_moe", "06_overlap", "08_mesh")])
def test_cuda_nccl_a_gpu_each(lesson, two_gpus_with_nccl, name):
    if not two_gpus_with_nccl:
        pytest.skip("no two GPUs with NCCL here")
    passes_on_stdout(lesson(name, 2, "--device", "cuda", "--backend", "nccl", separate=True)).has(NCCL_RAN)
