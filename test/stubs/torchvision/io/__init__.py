import enum

from .._stub import unavailable


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


decode_jpeg = decode_image = read_image = unavailable
