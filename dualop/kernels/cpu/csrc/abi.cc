// DualopArray's layout as this compiler lays it out, read by the test that checks the Python
// mirror (abi.DualopArray) against it: sizeof, then each field's offset in declaration order.
#include <cstddef>

#include "common.h"

extern "C" int dualop_array_layout(int64_t* out) {
  out[0] = sizeof(DualopArray);
  out[1] = offsetof(DualopArray, data);
  out[2] = offsetof(DualopArray, dtype);
  out[3] = offsetof(DualopArray, ndim);
  out[4] = offsetof(DualopArray, shape);
  out[5] = offsetof(DualopArray, strides);
  return 6;
}
