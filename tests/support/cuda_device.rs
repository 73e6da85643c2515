//! The CUDA device the GPU test files check on: GPU 0 when the machine has one, else the host
//! emulation (`cuda::use_emulation`), or `None` with the reason printed when neither is
//! available (`EMBERS_REQUIRE_CUDA_SIM=1`, set by CI, makes that a failure).

use embers::cuda;
use embers::Device;

/// The CUDA device under test, or `None` (reason printed).
pub fn device() -> Option<Device> {
    let gpu = cuda::emulated_devices() == 0 && cuda::device_count().is_ok_and(|n| n > 0);
    if !gpu {
        if let Err(e) = cuda::simulated_device(0) {
            let required = std::env::var("EMBERS_REQUIRE_CUDA_SIM").is_ok_and(|v| v == "1");
            assert!(!required, "EMBERS_REQUIRE_CUDA_SIM=1 but {e}");
            println!("skipped: no GPU and no host emulation: {e}");
            return None;
        }
        cuda::use_emulation(1);
    }
    let d = Device::cuda(0).expect("device 0 opens");
    println!("on {}", cuda::device(0).unwrap().name());
    Some(d)
}
