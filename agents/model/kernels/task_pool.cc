// The kernels' helper pool (common.h) as seen from Python: one pool for the whole kernel library.
#include "common.h"

// Turns the helper threads' polling for the next call on (1) or off (0, ending it now): agents.model.native_kernels.
extern "C" void KernelHelpersPoll(int on) { kernel_pool::TaskPool::instance().poll(on != 0); }
