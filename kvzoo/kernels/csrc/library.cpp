/* what the library was built with, asked once when it is loaded */

#include "common.h"

KV_EXPORT int kvzoo_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
