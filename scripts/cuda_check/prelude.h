#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __attribute__((always_inline))
struct dim3v { unsigned x, y, z; };
extern const __device__ dim3v threadIdx, blockIdx, blockDim, gridDim;
__device__ float __shfl_sync(unsigned, float, int);
__device__ float __shfl_xor_sync(unsigned, float, int);
__device__ float __int_as_float(int);
__device__ float fmaxf(float, float);
__device__ float expf(float);
__device__ float logf(float);
__device__ float sqrtf(float);
__device__ float rsqrtf(float);
__device__ float tanhf(float);
__device__ float fabsf(float);
__device__ double pow(double, double);
__device__ void sincos(double, double*, double*);
__device__ int atomicCAS(int*, int, int);
__device__ float atomicAdd(float*, float);
__device__ void __syncthreads();
__device__ float fminf(float, float); __device__ float powf(float, float);
