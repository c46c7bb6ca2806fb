//! brigade-autograd
