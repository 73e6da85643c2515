//! Moving values between devices: [`Tensor::to_device`], differentiable (the gradient moves
//! back).

use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::{Device, Result, Tensor};

struct ToDeviceBackward {
    source: Device,
}

impl BackwardOp for ToDeviceBackward {
    fn name(&self) -> &'static str {
        "to_device"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        Ok(vec![Some(Gradient::Dense(
            g.to_device_values(self.source)?,
        ))])
    }
}

impl Tensor {
    /// This tensor's values on `device` (the same tensor when already there). Differentiable:
    /// the gradient moves back to this tensor's device.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        let out = self.to_device_values(device)?;
        Ok(record_op(
            out,
            &[self],
            ToDeviceBackward {
                source: self.device(),
            },
        ))
    }
}
