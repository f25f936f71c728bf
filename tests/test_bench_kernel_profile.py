"""bench/kernel_profile.py: the table that says where a variant's step spends its time, by kernel."""

import torch

from bench.kernel_profile import KernelRow, KernelTable, kind_of, profile_steps, side_by_side


def test_kernels_named_by_cuda_libraries_and_compilers_fall_into_their_kinds():
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "products"
    assert kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "products"
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kind_of("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "generated"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "copies"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "other"


def test_a_profiled_step_counts_its_products_once_per_step():
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def step():
        (a @ b).relu().sum()

    table = profile_steps("eager", step, 3, torch.device("cpu"))
    mm = [r for r in table.rows if r.name == "aten::mm"]
    assert mm and mm[0].calls_per_step == 1.0 and mm[0].us_per_step > 0
    assert table.by_kind()["products"] >= mm[0].us_per_step
    assert "aten::mm" in table.text()


def test_the_side_by_side_table_has_a_column_per_variant_and_their_totals():
    a = KernelTable("inductor", 2, True, (KernelRow("sm90_xmma_gemm", 1, 1000.0), KernelRow("triton_poi_0", 2, 500.0)))
    b = KernelTable("accelrun", 2, True, (KernelRow("sm90_xmma_gemm", 1, 1000.0),))
    text = side_by_side([a, b])
    assert "| kind | inductor | accelrun |" in text
    assert "| generated | 0.500 ms | 0.000 ms |" in text
    assert "| all | 1.500 ms | 1.000 ms |" in text


def test_on_a_gpu_only_the_kernels_count_not_the_ops_that_launched_them(monkeypatch):
    """torch gives an ATen op the device time of the kernels it launched; counted beside the kernel's
    own row, every product counted twice on the GPU (a review)."""
    import torch.profiler

    from bench import kernel_profile

    class Event:
        def __init__(self, key, device_type, us):
            self.key, self.device_type, self.count = key, device_type, 2
            self.self_device_time_total, self.self_cpu_time_total = us, 1.0

    class FakeProfile:
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def key_averages(self):
            cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
            return [Event("aten::mm", cpu, 100.0), Event("sm90_xmma_gemm", cuda, 100.0)]

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    table = kernel_profile.profile_steps("accelrun", lambda: None, 2, torch.device("cuda"))
    assert [r.name for r in table.rows] == ["sm90_xmma_gemm"] and table.by_kind()["products"] == 50.0
