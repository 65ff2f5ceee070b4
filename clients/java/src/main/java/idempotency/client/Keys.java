package idempotency.client;

import java.io.ByteArrayOutputStream;
import java.math.BigDecimal;
import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;

/**
 * Stable event keys and payload fingerprints, byte for byte the forms of
 * clients/KEYS.md that the Python and Node clients use (pinned by
 * clients/testdata/key_vectors.json), so that every language claims the same
 * key for the same event.
 */
public final class Keys {
  /** Domain separation and version of the key encoding. */
  static final byte[] KEY_PREFIX = "idempotency-key/v1\n".getBytes(StandardCharsets.US_ASCII);
  /** Integers beyond ±(2^53 - 1) are refused in canonical JSON: JavaScript cannot hold them. */
  public static final long MAX_SAFE_INTEGER = (1L << 53) - 1;

  private static final BigInteger MAX_SAFE = BigInteger.valueOf(MAX_SAFE_INTEGER);

  private Keys() {}

  /**
   * The key of an event: the SHA-256, as 64 lowercase hex characters, of
   * {@link #keyEncoding(Object...)}. Fields are positional (their order
   * matters): String, byte[] or an integer (Integer, Long, Short, Byte,
   * BigInteger); the type is part of the key, so "1", bytes "1" and 1 differ.
   * One Map argument means named fields, as {@link #deriveKey(Map)}.
   *
   * <pre>{@code Keys.deriveKey("stripe", event.id())}</pre>
   *
   * @throws IllegalArgumentException no fields, another type (Boolean, null,
   *     floating point, lists...), or a String that is not valid Unicode
   */
  public static String deriveKey(Object... fields) {
    return hex(sha256(keyEncoding(fields)));
  }

  /** The key of named fields: the names are sorted (by UTF-8 bytes), so their order does not matter. */
  public static String deriveKey(Map<String, ?> named) {
    return hex(sha256(keyEncoding(named)));
  }

  /** The canonical bytes that deriveKey() hashes (KEYS.md). */
  public static byte[] keyEncoding(Object... fields) {
    if (fields == null) {
      throw new IllegalArgumentException("deriveKey: a field must be a String, byte[] or an integer, got null");
    }
    if (fields.length == 1 && fields[0] instanceof Map) {
      return keyEncoding((Map<?, ?>) fields[0]);
    }
    if (fields.length == 0) {
      throw new IllegalArgumentException("deriveKey: at least one field is needed");
    }
    ByteArrayOutputStream out = new ByteArrayOutputStream();
    out.writeBytes(KEY_PREFIX);
    out.write('L');
    writeU64(out, fields.length);
    for (Object field : fields) {
      encodeField(out, field);
    }
    return out.toByteArray();
  }

  /** The canonical bytes that deriveKey(Map) hashes (KEYS.md). */
  public static byte[] keyEncoding(Map<?, ?> named) {
    if (named == null || named.isEmpty()) {
      throw new IllegalArgumentException("deriveKey: at least one field is needed");
    }
    List<Object[]> entries = new ArrayList<>();
    for (Map.Entry<?, ?> entry : named.entrySet()) {
      if (!(entry.getKey() instanceof String)) {
        throw new IllegalArgumentException("deriveKey: field names must be Strings, got " + typeName(entry.getKey()));
      }
      entries.add(new Object[] {utf8((String) entry.getKey()), entry.getKey(), entry.getValue()});
    }
    entries.sort((a, b) -> Arrays.compareUnsigned((byte[]) a[0], (byte[]) b[0]));
    ByteArrayOutputStream out = new ByteArrayOutputStream();
    out.writeBytes(KEY_PREFIX);
    out.write('M');
    writeU64(out, entries.size());
    for (Object[] entry : entries) {
      encodeField(out, entry[1]);
      encodeField(out, entry[2]);
    }
    return out.toByteArray();
  }

  private static void encodeField(ByteArrayOutputStream out, Object value) {
    byte tag;
    byte[] body;
    if (value instanceof String) {
      tag = 's';
      body = utf8((String) value);
    } else if (value instanceof byte[]) {
      tag = 'b';
      body = (byte[]) value;
    } else if (isInteger(value)) {
      tag = 'i';
      body = toBigInteger(value).toString().getBytes(StandardCharsets.US_ASCII);
    } else {
      throw new IllegalArgumentException(
          "deriveKey: a field must be a String, byte[] or an integer, got " + typeName(value));
    }
    out.write(tag);
    writeU64(out, body.length);
    out.writeBytes(body);
  }

  /**
   * The SHA-256 (32 raw bytes) of a payload, for Claim's fingerprint: a
   * byte[] as it is (a webhook's raw body), a String as its UTF-8 bytes,
   * anything else (Map, List, Object[], integers, Boolean, null, integral
   * Double/BigDecimal) as its canonical JSON.
   */
  public static byte[] fingerprint(Object payload) {
    if (payload instanceof byte[]) {
      return sha256((byte[]) payload);
    }
    if (payload instanceof String) {
      return sha256(utf8((String) payload));
    }
    return sha256(canonicalJson(payload));
  }

  /**
   * RFC 8785 restricted to integers, as KEYS.md specifies: no whitespace,
   * object members sorted by UTF-16 code units, JavaScript's string escapes,
   * integers within ±(2^53 - 1) only (an integral 1.0 is written 1).
   */
  public static byte[] canonicalJson(Object value) {
    StringBuilder out = new StringBuilder();
    writeJson(out, value);
    return utf8(out.toString());
  }

  private static void writeJson(StringBuilder out, Object value) {
    if (value == null) {
      out.append("null");
    } else if (value instanceof Boolean) {
      out.append(((Boolean) value) ? "true" : "false");
    } else if (value instanceof String) {
      writeJsonString(out, (String) value);
    } else if (value instanceof Number) {
      out.append(canonicalInteger((Number) value));
    } else if (value instanceof Map) {
      List<String> names = new ArrayList<>();
      for (Object name : ((Map<?, ?>) value).keySet()) {
        if (!(name instanceof String)) {
          throw new IllegalArgumentException("fingerprint: object keys must be Strings, got " + typeName(name));
        }
        names.add((String) name);
      }
      names.sort(null); // String.compareTo: by UTF-16 code units, as JavaScript sorts
      out.append('{');
      for (int i = 0; i < names.size(); i++) {
        if (i > 0) {
          out.append(',');
        }
        writeJsonString(out, names.get(i));
        out.append(':');
        writeJson(out, ((Map<?, ?>) value).get(names.get(i)));
      }
      out.append('}');
    } else if (value instanceof List || value instanceof Object[]) {
      List<?> items = value instanceof List ? (List<?>) value : Arrays.asList((Object[]) value);
      out.append('[');
      for (int i = 0; i < items.size(); i++) {
        if (i > 0) {
          out.append(',');
        }
        writeJson(out, items.get(i));
      }
      out.append(']');
    } else {
      throw new IllegalArgumentException("fingerprint: cannot encode " + typeName(value) + " as canonical JSON");
    }
  }

  private static void writeJsonString(StringBuilder out, String text) {
    utf8(text); // lone surrogates have no UTF-8 form: reject them
    out.append('"');
    for (int i = 0; i < text.length(); i++) {
      char c = text.charAt(i);
      switch (c) {
        case '"':
          out.append("\\\"");
          break;
        case '\\':
          out.append("\\\\");
          break;
        case '\b':
          out.append("\\b");
          break;
        case '\f':
          out.append("\\f");
          break;
        case '\n':
          out.append("\\n");
          break;
        case '\r':
          out.append("\\r");
          break;
        case '\t':
          out.append("\\t");
          break;
        default:
          if (c < 0x20) {
            out.append(String.format("\\u%04x", (int) c));
          } else {
            out.append(c);
          }
      }
    }
    out.append('"');
  }

  private static String canonicalInteger(Number number) {
    BigInteger integer;
    if (isInteger(number)) {
      integer = toBigInteger(number);
    } else {
      BigDecimal decimal;
      if (number instanceof BigDecimal) {
        decimal = (BigDecimal) number;
      } else if (number instanceof Double || number instanceof Float) {
        double d = number.doubleValue();
        if (Double.isNaN(d) || Double.isInfinite(d)) {
          throw new IllegalArgumentException("fingerprint: " + number + " is not an integer");
        }
        decimal = new BigDecimal(d);
      } else {
        throw new IllegalArgumentException("fingerprint: cannot encode " + typeName(number) + " as canonical JSON");
      }
      try {
        integer = decimal.toBigIntegerExact();
      } catch (ArithmeticException fractional) {
        throw new IllegalArgumentException(
            "fingerprint: " + number + " is not an integer; encode it as a string or in minor units");
      }
    }
    if (integer.abs().compareTo(MAX_SAFE) > 0) {
      throw new IllegalArgumentException("fingerprint: " + integer + " is beyond ±(2^53 - 1); encode it as a string");
    }
    return integer.toString();
  }

  private static boolean isInteger(Object value) {
    return value instanceof Integer || value instanceof Long || value instanceof Short || value instanceof Byte
        || value instanceof BigInteger;
  }

  private static BigInteger toBigInteger(Object value) {
    return value instanceof BigInteger ? (BigInteger) value : BigInteger.valueOf(((Number) value).longValue());
  }

  private static void writeU64(ByteArrayOutputStream out, long n) {
    out.writeBytes(ByteBuffer.allocate(8).putLong(n).array());
  }

  /** UTF-8, refusing text that is not valid Unicode (a lone surrogate). */
  static byte[] utf8(String text) {
    try {
      ByteBuffer encoded = StandardCharsets.UTF_8.newEncoder()
          .onMalformedInput(CodingErrorAction.REPORT)
          .onUnmappableCharacter(CodingErrorAction.REPORT)
          .encode(CharBuffer.wrap(text));
      byte[] bytes = new byte[encoded.remaining()];
      encoded.get(bytes);
      return bytes;
    } catch (CharacterCodingException invalid) {
      throw new IllegalArgumentException("text that is not valid Unicode (a lone surrogate?)", invalid);
    }
  }

  private static byte[] sha256(byte[] data) {
    try {
      return MessageDigest.getInstance("SHA-256").digest(data);
    } catch (NoSuchAlgorithmException impossible) {
      throw new IllegalStateException(impossible);
    }
  }

  /** Lowercase hexadecimal. */
  public static String hex(byte[] bytes) {
    StringBuilder out = new StringBuilder(bytes.length * 2);
    for (byte b : bytes) {
      out.append(Character.forDigit((b >> 4) & 0xf, 16)).append(Character.forDigit(b & 0xf, 16));
    }
    return out.toString();
  }

  private static String typeName(Object value) {
    return value == null ? "null" : value.getClass().getSimpleName();
  }
}
