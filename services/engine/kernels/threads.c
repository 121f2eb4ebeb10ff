/* Binds the OpenMP threads of the calling thread's team, one to each CPU.
 *
 * torch's intra-op pool, MKL's and these kernels' are one libgomp team per calling thread, and
 * libgomp keeps a team's threads from one parallel region to the next (same size, same order),
 * so pinning them once, from the thread that runs the model, holds for every later product,
 * element-wise op and kernel it runs. Thread 0 is the calling thread itself.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

/* cpus[num_cpus]: thread i goes to cpus[i]. Returns how many threads could not be bound. */
int32_t bind_threads(const int64_t *cpus, int32_t num_cpus) {
    int32_t failed = 0;
#pragma omp parallel num_threads(num_cpus) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)cpus[omp_get_thread_num()], &set);
        failed += sched_setaffinity(0, sizeof set, &set) != 0;
        if (omp_get_num_threads() != num_cpus && omp_get_thread_num() == 0)
            failed += num_cpus - omp_get_num_threads();
    }
    return failed;
}
