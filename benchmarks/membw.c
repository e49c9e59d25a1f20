// Memory read bandwidth on 1 and 2 threads: an AVX2 sum over 1 GiB, best
// of 5 (the roofline of docs/benchmarks.md):
//     gcc -O2 -mavx2 -pthread benchmarks/membw.c -o /tmp/membw && /tmp/membw
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define N (1UL<<28) /* floats = 1 GiB */
static float *a; static int T;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void* run(void*p){long id=(long)p; size_t lo=N/T*id, hi=N/T*(id+1); __m256 s0=_mm256_setzero_ps(),s1=s0,s2=s0,s3=s0;
 for(size_t i=lo;i<hi;i+=32){s0=_mm256_add_ps(s0,_mm256_load_ps(a+i));s1=_mm256_add_ps(s1,_mm256_load_ps(a+i+8));s2=_mm256_add_ps(s2,_mm256_load_ps(a+i+16));s3=_mm256_add_ps(s3,_mm256_load_ps(a+i+24));}
 float r[8]; _mm256_storeu_ps(r,_mm256_add_ps(_mm256_add_ps(s0,s1),_mm256_add_ps(s2,s3))); return (void*)(long)(r[0]>1e30);}
int main(){a=aligned_alloc(64,N*4); for(size_t i=0;i<N;i++)a[i]=1; for(T=1;T<=2;T++){double best=1e9; for(int r=0;r<5;r++){pthread_t th[2]; double t0=now(); for(long i=0;i<T;i++)pthread_create(&th[i],0,run,(void*)i); for(int i=0;i<T;i++)pthread_join(th[i],0); double dt=now()-t0; if(dt<best)best=dt;} printf("%d thread(s): %.1f GB/s\n",T,N*4/best/1e9);} }
