// Host side of the kernels launched with cudaLaunchKernelEx: the configuration, with a 1-D
// thread-block cluster when asked for (the Hopper kernels' TMA-multicast variants).
#pragma once

#include <cuda_runtime.h>

namespace mila {

// cudaLaunchConfig_t for grid x block with `smem` bytes of dynamic shared memory on `stream`;
// cluster_x > 1 adds the cluster dimension {cluster_x, 1, 1}, 1 is a plain launch. Not
// copyable: cfg.attrs points at this object's own attribute.
struct ClusterLaunchConfig {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1]{};

  ClusterLaunchConfig(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      unsigned cluster_x) {
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster_x;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cluster_x > 1 ? 1 : 0;
  }
  ClusterLaunchConfig(const ClusterLaunchConfig&) = delete;
  ClusterLaunchConfig& operator=(const ClusterLaunchConfig&) = delete;
};

}  // namespace mila
