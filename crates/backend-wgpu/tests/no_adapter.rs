//! Without a usable adapter, opening the backend is a typed error that says
//! what to install — never a panic. (Its own test binary: it sets an
//! environment variable that no other test may see.)

use vellum_backend_wgpu::WgpuOps;
use vellum_base::Error;

#[test]
fn no_adapter_is_a_typed_error_saying_what_to_install() {
    // An adapter name that matches nothing hides every adapter there is.
    std::env::set_var("VELLUM_WGPU_ADAPTER", "no-such-adapter-anywhere");
    match WgpuOps::new() {
        Err(Error::Unavailable { what, hint }) => {
            assert!(what.contains("wgpu adapter"), "{what}");
            assert!(hint.contains("mesa-vulkan-drivers"), "{hint}");
        }
        other => panic!("expected Error::Unavailable, got {other:?}"),
    }
}
