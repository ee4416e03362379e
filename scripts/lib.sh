# Shared by the scripts: lesson lookup and the mpirun command.
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun --oversubscribe -q --bind-to none --mca odls_base_sigkill_timeout 0 --mca pml ob1 $( [ "$(id -u)" = 0 ] && echo --allow-run-as-root )}

# lesson_dir 01 -> lessons/01_online_softmax (or nothing)
lesson_dir() { ls -d lessons/"$1"_* 2>/dev/null | head -n 1; }
# default rank count of a lesson directory
lesson_np() { cat "$1/NP" 2>/dev/null || echo 1; }
