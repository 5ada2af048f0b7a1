// The kernels' helper pool (common.h) as seen from Python: one pool for the whole kernel library.
#include "common.h"

// Ends the helper threads' polling for the next call until the next kernel call (agents.native_kernels).
extern "C" void KernelHelpersRest() { kernel_pool::TaskPool::instance().rest(); }
