/* Open MPI's own floor for benchmarks/allreduce_vs_mpi.py: MPI_Allreduce (float32 sum, in
   place, MPI_COMM_WORLD) called and timed in C, so no Python runs between calls. The
   script builds it with mpicc into a temporary directory and loads it with ctypes into the
   ranks mpi4py has already initialised (one libmpi in the process). Timing matches the
   script's Python loops: a barrier, then back to back or one call at a time. */
#include <mpi.h>
#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void allreduce(float *buf, int count) {
  MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

/* Seconds per call of `iters` calls issued back to back (the caller synchronises first). */
double floor_back_to_back(float *buf, int count, int iters) {
  double start = now_s();
  for (int i = 0; i < iters; ++i) allreduce(buf, count);
  return (now_s() - start) / iters;
}

/* `iters` calls each after a barrier; the seconds of each land in `out`. */
void floor_per_call(float *buf, int count, int iters, double *out) {
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double start = now_s();
    allreduce(buf, count);
    out[i] = now_s() - start;
  }
}
