//! brigade-comm
